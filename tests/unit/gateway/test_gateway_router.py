"""LeastInFlightRouter: least in-flight first, ties round-robin, failed workers skipped a while."""

from __future__ import annotations

import time

import pytest

from gateway.router import LeastInFlightRouter
from services.errors import Unavailable
from tessera.v1 import common_pb2

WORKERS = [common_pb2.WorkerInfo(address=a, base_model="b", healthy=True) for a in ("w:3", "w:1", "w:2")]


def test_ties_round_robin_in_address_order() -> None:
    router = LeastInFlightRouter()
    assert [router.pick("b", WORKERS).address for _ in range(6)] == ["w:1", "w:2", "w:3"] * 2


def test_least_in_flight_wins() -> None:
    router = LeastInFlightRouter()
    router.started("w:1")
    router.started("w:1")
    router.started("w:2")
    assert router.pick("b", WORKERS).address == "w:3"
    router.finished("w:1")
    router.finished("w:1")
    assert router.in_flight("w:1") == 0
    assert {router.pick("b", WORKERS).address for _ in range(4)} == {"w:1", "w:3"}


def test_marked_down_worker_is_skipped_until_the_time_passes() -> None:
    router = LeastInFlightRouter(mark_down_s=0.05)
    router.mark_down("w:1")
    router.mark_down("w:2")
    assert {router.pick("b", WORKERS).address for _ in range(4)} == {"w:3"}
    time.sleep(0.06)
    assert {router.pick("b", WORKERS).address for _ in range(6)} == {"w:1", "w:2", "w:3"}


def test_no_worker_is_unavailable() -> None:
    router = LeastInFlightRouter()
    with pytest.raises(Unavailable, match="no healthy worker serves base model 'b'"):
        router.pick("b", [])
    router.mark_down("w:1")
    with pytest.raises(Unavailable, match="1 recently failed"):
        router.pick("b", WORKERS[1:2])
