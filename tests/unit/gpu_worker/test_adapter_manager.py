"""The adapter manager: loads off the caller's thread from arrival, the host tier, pins, versions by
digest, failures that fail only their version (and are remembered a while), the eviction policy."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

from gpu_worker.lora.adapter_manager import AdapterManager
from policy.load_failures import RecentFailures
from gpu_worker.lora.loader import AdapterRef
from services.common.errors import AdapterLoadFailed, FailedPrecondition
from services.common.task_heads import TaskHead
from policy.eviction import LRU, LFUDecay

from .adapter_fakes import Clock, Disk, installed, manager, poll_until, ref


def _use(adapters: AdapterManager, adapter: AdapterRef) -> tuple[int, int]:
    """One request for `adapter`, from arrival to its end once its adapter is usable: its (slot, rank)."""
    adapters.arrive(adapter)
    poll_until(adapters, lambda: adapters.resident(adapter) is not None)
    placed = adapters.resident(adapter)
    adapters.depart(adapter)
    return placed


def _loads(adapters: AdapterManager) -> dict[str, int]:
    return {times.source: times.count for times in adapters.stats().loads}


def test_a_load_starts_at_arrival_beside_the_caller_and_installs_the_weights_read():
    disk = Disk()
    adapters, module = manager(2, disk)
    woken = threading.Event()
    adapters.wake = woken.set
    sql = ref("sql")
    disk.hold(sql)
    adapters.arrive(sql)  # returns while the read waits on the disk
    assert not woken.is_set()
    for _ in range(3):
        adapters.poll()
        assert adapters.resident(sql) is None
    assert adapters.stats().loading_adapters == ("sql",)
    disk.release(sql)
    assert woken.wait(5)  # the loader thread wakes the engine
    assert disk.threads == ["adapter-loader_0"]
    poll_until(adapters, lambda: adapters.resident(sql) is not None)
    slot, rank = adapters.resident(sql)
    a, b, _ = disk.weights[sql.sha256].modules[(0, "q_proj")]
    assert rank == 4 and all(map(torch.equal, installed(module, slot), (a, b)))
    assert module.lora.host_scalings[slot] == [0.5]
    adapters.arrive(sql)  # usable at arrival: a hit
    stats = adapters.stats()
    assert (stats.hits, stats.misses, stats.pinned, stats.gpu_adapters, stats.loading_adapters) == (1, 1, 2, ("sql",), ())
    assert _loads(adapters) == {"disk": 1, "host": 1}


def test_pins_keep_the_adapters_of_waiting_requests_on_the_gpu():
    disk = Disk()
    adapters, _ = manager(2, disk)
    a, b, c = ref("a"), ref("b"), ref("c")
    for adapter in (a, b):
        adapters.arrive(adapter)  # requests that have not been admitted yet hold their adapters too
    poll_until(adapters, lambda: adapters.resident(a) is not None and adapters.resident(b) is not None)
    slot_b = adapters.resident(b)[0]
    adapters.arrive(c)
    poll_until(adapters, lambda: adapters.stats().host_adapters == ("a", "b", "c"))  # read, but no GPU room
    for _ in range(3):
        adapters.poll()
    assert adapters.resident(c) is None and adapters.stats().loading_adapters == ("c",)
    adapters.depart(b)
    adapters.poll()
    assert adapters.resident(c)[0] == slot_b and adapters.resident(a) is not None and adapters.resident(b) is None
    stats = adapters.stats()
    assert stats.gpu_adapters == ("a", "c") and stats.host_adapters == ("a", "b", "c") and stats.gpu_evictions == 1


def test_an_adapter_evicted_from_the_gpu_comes_back_from_host_memory_without_a_read():
    disk = Disk()
    adapters, module = manager(1, disk)
    a, b = ref("a"), ref("b")
    _use(adapters, a)
    _use(adapters, b)                     # a leaves the GPU for host memory
    assert adapters.stats().host_adapters == ("a", "b")
    slot, _ = _use(adapters, a)
    assert disk.reads == ["a", "b"] and _loads(adapters) == {"disk": 2, "host": 3}
    assert torch.equal(installed(module, slot)[0], disk.weights[a.sha256].modules[(0, "q_proj")][0])


def test_an_adapter_evicted_from_host_memory_too_is_read_again():
    disk = Disk()
    adapters, _ = manager(1, disk, host_slots=1)
    a, b = ref("a"), ref("b")
    for adapter in (a, b, a):
        _use(adapters, adapter)
    stats = adapters.stats()
    assert disk.reads == ["a", "b", "a"] and (stats.host_evictions, stats.gpu_evictions) == (2, 2)
    assert stats.host_adapters == ("a",) and stats.host_versions == 1


def test_a_new_version_serves_new_requests_while_the_old_one_finishes_then_leaves_every_tier():
    disk = Disk()
    adapters, module = manager(2, disk)
    v0, v1, v2 = ref("sql", 0), ref("sql", 1), ref("sql", 2)
    adapters.arrive(v0)
    poll_until(adapters, lambda: adapters.resident(v0) is not None)
    adapters.arrive(v1)                   # re-registered: same name, new digest, another adapter
    poll_until(adapters, lambda: adapters.resident(v1) is not None)
    (s0, _), (s1, _) = adapters.resident(v0), adapters.resident(v1)
    assert s0 != s1 and torch.equal(installed(module, s1)[0], disk.weights[v1.sha256].modules[(0, "q_proj")][0])
    stats = adapters.stats()
    assert stats.gpu_adapters == ("sql",) and (stats.gpu_versions, stats.host_versions) == (2, 2)
    adapters.depart(v0)                   # the old version's last request ended: it leaves every tier
    stats = adapters.stats()
    assert adapters.resident(v0) is None and (stats.gpu_versions, stats.host_versions, stats.pinned) == (1, 1, 1)
    adapters.depart(v1)
    adapters.arrive(v2)                   # v1 has no request left: it goes as v2 arrives
    stats = adapters.stats()
    assert adapters.resident(v1) is None and (stats.gpu_versions, stats.host_versions) == (0, 1)  # v2's room
    poll_until(adapters, lambda: adapters.resident(v2) is not None)
    assert disk.reads == ["sql"] * 3


@pytest.mark.parametrize("error", [ValueError("bad value"), OSError(5, "Input/output error", "/store/x/adapter_config.json"),
                                   RuntimeError("CUDA error: out of memory"), FailedPrecondition("checksum mismatch")],
                         ids=["ValueError", "OSError", "RuntimeError", "TesseraError"])
def test_a_failed_load_fails_its_version_only_and_is_remembered_a_while(error):
    disk, clock = Disk(), Clock()
    adapters, _ = manager(1, disk, clock=clock)
    broken, good = ref("broken"), ref("good")
    disk.broken[broken.sha256] = error
    for adapter in (broken, broken, good):
        adapters.arrive(adapter)
    poll_until(adapters, lambda: adapters.failure(broken) is not None and adapters.resident(good) is not None)
    failure = adapters.failure(broken)
    assert isinstance(failure, AdapterLoadFailed) and failure.message.startswith("adapter broken could not be loaded: ")
    assert "/store/x" not in failure.message  # a file's name, never the store's paths
    assert adapters.failure(good) is None
    adapters.depart(broken)
    adapters.depart(broken)
    adapters.arrive(broken)               # within the failure's lifetime: failed at once, no read
    assert adapters.failure(broken).message == failure.message and disk.reads.count("broken") == 1
    adapters.depart(broken)
    stats = adapters.stats()
    assert (stats.load_failures, stats.host_versions, stats.pinned, stats.gpu_adapters) == (1, 1, 1, ("good",))
    clock.now += 10.5                     # forgotten: the next request reads the files again
    del disk.broken[broken.sha256]
    adapters.depart(good)
    assert _use(adapters, broken) is not None and disk.reads.count("broken") == 2


def test_a_load_failing_again_and_again_is_retried_with_a_doubling_capped_backoff_one_line_each(caplog):
    """A broken adapter that something keeps asking for (the placement plan naming it hot) is read at
    t = 0, 10, 30, 70, ... s (ttl 10 s doubled per failure, capped at 300 s), never in between; each
    attempt logs one line without a traceback and counts one load failure; a load that succeeds resets it."""
    disk, clock = Disk(), Clock()
    adapters, _ = manager(1, disk, clock=clock)
    broken = ref("broken")
    disk.broken[broken.sha256] = FailedPrecondition("checksum mismatch")
    attempts_at = []
    with caplog.at_level(logging.INFO, logger="gpu_worker.lora.adapter_manager"):
        while clock.now < 1300:
            if adapters.residency.preload(broken, rate=1.0):  # the plan's order, at every heartbeat answer
                attempts_at.append(clock.now)
                poll_until(adapters, lambda: adapters.failure(broken) is not None)
            clock.now += 1.0
    assert attempts_at == [0, 10, 30, 70, 150, 310, 610, 910, 1210]
    assert disk.reads.count("broken") == len(attempts_at) == adapters.stats().load_failures
    lines = [r for r in caplog.records if "could not be loaded" in r.getMessage()]
    assert [r.exc_info for r in lines] == [None] * len(attempts_at)
    assert "attempt 6; failing its requests, next attempt in 300 s" in lines[5].getMessage()
    del disk.broken[broken.sha256]  # mended: the attempt after the backoff loads it
    clock.now = 1510
    assert _use(adapters, broken) is not None


def test_registering_a_failed_adapter_again_retries_it_at_once():
    """Its stored copy was tampered with; the operator registers the same content again (the registry replaces
    the copy): requests under the newer registration read it at once, not after the backoff."""
    disk, clock = Disk(), Clock()
    adapters, _ = manager(1, disk, clock=clock)
    broken = dataclasses.replace(ref("broken"), registered_ms=1_000_000)
    disk.broken[broken.sha256] = FailedPrecondition("checksum mismatch")
    adapters.arrive(broken)
    poll_until(adapters, lambda: adapters.failure(broken) is not None)
    adapters.depart(broken)
    assert adapters.failure(broken) is not None, "the same registration waits out its backoff"
    del disk.broken[broken.sha256]
    again = dataclasses.replace(broken, registered_ms=1_000_400)
    assert adapters.failure(again) is None
    assert _use(adapters, again) is not None and disk.reads.count("broken") == 2


def test_a_success_starts_the_backoff_again():
    clock = Clock()
    failures = RecentFailures(10.0, 300.0, clock)
    assert [failures.remember("v", ValueError("x")).backoff_s for _ in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    failures.succeeded("v")
    assert failures.cause("v") is None and failures.remember("v", ValueError("x")).backoff_s == 10
    assert failures.count == 8


def test_failures_say_whether_any_backoff_still_runs_so_the_scheduler_skips_its_queue_scan_otherwise():
    clock = Clock()
    failures = RecentFailures(10.0, 300.0, clock)
    assert not failures
    failures.remember("v", ValueError("x"))      # backoff until 10
    clock.now = 5.0
    failures.remember("w", ValueError("x"))      # until 15
    clock.now = 12.0
    assert failures and failures.cause("v") is None and failures.cause("w") is not None
    clock.now = 15.0
    assert not failures and failures.cause("w") is None


def test_load_now_waits_for_the_adapter_and_raises_when_it_fails():
    disk = Disk()
    adapters, _ = manager(1, disk)
    sql, broken = ref("sql", rank=2), ref("broken")
    disk.broken[broken.sha256] = ValueError("no")
    assert adapters.load_now(sql) == (0, 2)
    with pytest.raises(AdapterLoadFailed, match="adapter broken could not be loaded: ValueError: no"):
        adapters.load_now(broken)
    adapters.depart(sql)
    assert adapters.stats().pinned == 0


@pytest.mark.parametrize("eviction, evicted", [(LFUDecay(half_life_s=100.0), "cold"), (LRU(), "hot")],
                         ids=["lfu", "lru"])
def test_the_eviction_policy_picks_who_leaves_a_full_gpu_tier(eviction, evicted):
    disk, clock = Disk(), Clock()
    adapters, _ = manager(2, disk, eviction=eviction, clock=clock)
    for name in ("hot", "hot", "hot", "cold", "new"):
        clock.now += 1.0
        _use(adapters, ref(name))
    assert set(adapters.stats().gpu_adapters) == {"hot", "cold", "new"} - {evicted}


def test_an_adapter_larger_than_a_whole_tier_fails_at_once_and_others_load():
    """A task head or tower LoRA can make an adapter larger than one of the largest rank the tiers were sized
    for: if no room can ever hold it, its requests fail with the reason instead of waiting for room forever."""
    disk = Disk()
    adapters, _ = manager(1, disk)
    head = TaskHead("mlp", ("a", "b"), (("task_head.fc1.weight", (4096, 4096)),))
    huge, good = dataclasses.replace(ref("huge"), head=head), ref("good")
    adapters.arrive(huge)
    adapters.arrive(good)
    poll_until(adapters, lambda: adapters.resident(good) is not None)
    failure = adapters.failure(huge)
    assert failure is not None and "more than this worker's whole GPU adapter tier" in failure.message
    assert "huge" not in disk.reads  # never read
