"""policy/routing/worker_state.py: freshness on an injected clock, the gateway's own dispatches
shown until a newer report, base-model filtering and address order."""

from __future__ import annotations

from policy.adapter_tiers import Tier
from policy.batch_summary import BatchEntry
from policy.routing.worker_state import WorkerState, WorkerStateTable
from gateway.state_feed import worker_state
from tessera.v1 import worker_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state(address: str, at: float, base_model: str = "llama", running: tuple = (), queued: tuple = (),
          gpu: frozenset = frozenset(), slo: float | None = None) -> WorkerState:
    return WorkerState(address=address, base_model=base_model, kind="k", running=running, queued=queued,
                       gpu_adapters=gpu, host_adapters=gpu | {"h"}, gpu_adapter_slots=4, max_batch=8,
                       free_kv_tokens=1000, tightest_tpot_slo_s=slo, timestamp=at)


def test_a_worker_that_stops_reporting_leaves_rotation_and_comes_back_when_it_reports() -> None:
    clock = Clock()
    table = WorkerStateTable(clock, stale_after_s=0.5)
    table.report(state("w1", 0.0))
    table.report(state("w2", 0.0))
    clock.now = 0.4
    table.report(state("w2", 0.4))
    assert [w.address for w in table.candidates("llama")] == ["w1", "w2"]
    clock.now = 0.6
    assert [w.address for w in table.candidates("llama")] == ["w2"]   # w1: last report 0.6 s old
    table.report(state("w1", 0.6))
    assert [w.address for w in table.candidates("llama")] == ["w1", "w2"]


def test_candidates_serve_the_base_model_in_address_order() -> None:
    table = WorkerStateTable(Clock())
    for address, model in (("w3", "llama"), ("w1", "llama"), ("w2", "qwen")):
        table.report(state(address, 0.0, base_model=model))
    assert [w.address for w in table.candidates("llama")] == ["w1", "w3"]
    assert table.candidates("mistral") == []


def test_dispatches_show_until_a_report_taken_after_them() -> None:
    clock = Clock()
    table = WorkerStateTable(clock)
    table.report(state("w1", 0.0, running=(BatchEntry("x", 8, 100),), slo=0.009))
    clock.now = 0.05
    table.dispatched("w1", BatchEntry("new", 16, 300), tpot_slo_s=0.007)
    view = table.candidates("llama")[0]
    assert view.queued == (BatchEntry("new", 16, 300),)
    assert view.load == 2
    assert view.tier("new") is Tier.GPU            # the worker loads it on arrival
    assert view.tightest_tpot_slo_s == 0.007
    assert view.batch.requests == 2 and view.batch.tokens == 400

    table.report(state("w1", 0.04))                # taken before the dispatch: it is still pending
    assert table.candidates("llama")[0].load == 1
    table.report(state("w1", 0.1, queued=(BatchEntry("new", 16, 300),)))  # now the worker has it
    assert table.candidates("llama")[0].queued == (BatchEntry("new", 16, 300),)


def test_an_older_report_arriving_late_is_ignored() -> None:
    table = WorkerStateTable(Clock())
    table.report(state("w1", 0.2, running=(BatchEntry("x", 8, 1),)))
    table.report(state("w1", 0.1))
    assert table.candidates("llama")[0].load == 1


def test_tiers_as_reported() -> None:
    s = state("w1", 0.0, gpu=frozenset({"g"}))
    assert (s.tier("g"), s.tier("h"), s.tier("nowhere")) == (Tier.GPU, Tier.HOST, Tier.DISK)


def test_a_pushed_state_names_the_adapters_on_their_way_and_its_gpu_victims_rate() -> None:
    message = worker_pb2.WorkerState(base_model="llama", perf_model="k", gpu_adapters=["g"], host_adapters=["h"],
                                     loading_adapters=["h", "d"], max_batch=8, gpu_victim_rate=0.25)
    s = worker_state("w1:1", message, None, 0.0)
    assert s.loading_adapters == {"h", "d"} and s.gpu_victim_rate == 0.25
    assert (s.tier("g"), s.tier("h"), s.tier("d")) == (Tier.GPU, Tier.HOST, Tier.DISK)
