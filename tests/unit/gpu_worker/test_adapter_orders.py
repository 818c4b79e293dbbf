"""The registry's orders for a worker's adapter tiers: retire (DELETE drains: in-flight requests finish,
then every tier frees the version), an operator's pin (never evicted until lifted) and preload (loaded
without a request, evictable), applied by the engine thread's OrderBook; and what the manager reports
of each version (tier, loading, pinned)."""

from __future__ import annotations

import torch

from gpu_worker.lora.adapter_manager import AdapterManager
from policy.residency_edge import AdapterPlacement
from gpu_worker.lora.loader import AdapterRef
from policy.placement_orders import OrderBook, PlacementOrders, Preload
from services.common.errors import FailedPrecondition
from policy.adapter_tiers import Tier

from .adapter_fakes import Clock, Disk, installed, manager, poll_until, ref


def _placed(adapters: AdapterManager) -> dict[str, tuple[Tier, bool, bool]]:
    """name -> (tier, loading, pinned) of each name's newest version."""
    return {p.name: (p.tier, p.loading, p.pinned) for p in adapters.stats().placements if p.newest}


def _use(adapters: AdapterManager, adapter: AdapterRef) -> None:
    adapters.arrive(adapter)
    poll_until(adapters, lambda: adapters.resident(adapter) is not None)
    adapters.depart(adapter)


def test_a_retired_version_serves_its_in_flight_requests_then_leaves_every_tier():
    disk = Disk()
    adapters, module = manager(2, disk)
    sql, other = ref("sql"), ref("other")
    adapters.arrive(sql)                  # in flight when the DELETE comes
    poll_until(adapters, lambda: adapters.resident(sql) is not None)
    _use(adapters, other)
    adapters.residency.retire("sql", sql.sha256)
    slot, _ = adapters.resident(sql)      # the request in flight keeps its weights
    assert torch.equal(installed(module, slot)[0], disk.weights[sql.sha256].modules[(0, "q_proj")][0])
    stats = adapters.stats()
    assert stats.gpu_adapters == ("other",) and stats.host_adapters == ("other",)  # no longer listed
    assert stats.gpu_versions == 2
    adapters.depart(sql)                  # its last request ended: gone from the GPU and host memory
    stats = adapters.stats()
    assert adapters.resident(sql) is None and (stats.gpu_versions, stats.host_versions) == (1, 1)
    assert [p.name for p in stats.placements] == ["other"]
    adapters.residency.retire("sql", sql.sha256)    # the registry repeats its answer until the worker stops listing it
    adapters.residency.retire("never-held", "0" * 64)
    assert adapters.stats().placements == stats.placements


def test_retiring_one_name_of_a_shared_version_keeps_it_for_the_other():
    disk = Disk()
    adapters, _ = manager(2, disk)
    a = ref("a")
    twin = AdapterRef("twin", a.base_model, a.rank, a.sha256, a.storage_path)  # the same files, registered twice
    _use(adapters, a)
    _use(adapters, twin)
    adapters.residency.retire("a", a.sha256)
    stats = adapters.stats()
    assert stats.gpu_adapters == ("twin",) and stats.gpu_versions == 1 and disk.reads == ["a"]
    adapters.residency.retire("twin", a.sha256)
    assert adapters.stats().gpu_versions == adapters.stats().host_versions == 0


def test_a_pin_loads_without_a_request_and_is_never_evicted_until_lifted():
    disk = Disk()
    adapters, _ = manager(2, disk)
    pinned, a, b = ref("pinned"), ref("a"), ref("b")
    disk.hold(pinned)
    assert adapters.residency.pin(pinned)
    assert _placed(adapters) == {"pinned": (Tier.DISK, True, True)}  # on its way from disk
    disk.release(pinned)
    poll_until(adapters, lambda: adapters.resident(pinned) is not None)
    assert _placed(adapters) == {"pinned": (Tier.GPU, False, True)}
    assert adapters.residency.operator_pins == {pinned.sha256}
    _use(adapters, a)                     # the other slot
    _use(adapters, b)                     # a leaves the GPU, not the pinned adapter
    assert adapters.stats().gpu_adapters == ("b", "pinned")
    adapters.arrive(b)                    # b's request holds it: a waits in host memory
    adapters.arrive(a)
    for _ in range(3):
        adapters.poll()
    assert adapters.resident(a) is None and _placed(adapters)["a"] == (Tier.HOST, True, False)
    adapters.residency.unpin(pinned.sha256)
    adapters.poll()
    assert adapters.resident(a) is not None and adapters.resident(pinned) is None
    assert _placed(adapters)["pinned"] == (Tier.HOST, False, False)  # unpinned, evictable, still cached
    adapters.residency.unpin(pinned.sha256)         # lifting a lifted pin is a no-op


def test_pins_may_hold_at_most_half_of_the_gpu_adapter_memory():
    disk = Disk()
    adapters, _ = manager(4, disk)
    a, b, c = ref("a"), ref("b"), ref("c")
    assert adapters.residency.pin(a) and adapters.residency.pin(b) and adapters.residency.pin(a)
    assert not adapters.residency.pin(c)            # a third would leave requests one slot in four
    assert adapters.residency.operator_pins == {a.sha256, b.sha256} and "c" not in _placed(adapters)
    adapters.residency.unpin(a.sha256)
    assert adapters.residency.pin(c)


def test_a_preload_records_no_access_and_leaves_first_when_room_is_needed():
    clock = Clock()
    disk = Disk()
    adapters, _ = manager(2, disk, clock=clock)
    a, pre, b = ref("a"), ref("pre"), ref("b")
    _use(adapters, a)
    clock.now += 1
    adapters.residency.preload(pre)
    poll_until(adapters, lambda: adapters.resident(pre) is not None)
    assert adapters.stats().gpu_adapters == ("a", "pre") and adapters.stats().pinned == 0
    adapters.residency.preload(pre)                 # there already: nothing to do
    clock.now += 1
    _use(adapters, b)                     # the GPU is full: the never-requested preload goes, not a
    assert adapters.stats().gpu_adapters == ("a", "b") and disk.reads == ["a", "pre", "b"]


def test_a_failed_pin_is_lifted_and_retried_once_the_failure_expires():
    clock = Clock()
    disk = Disk()
    adapters, _ = manager(2, disk, clock=clock)
    broken = ref("broken")
    disk.broken[broken.sha256] = FailedPrecondition("checksum mismatch")
    adapters.residency.pin(broken)
    poll_until(adapters, lambda: adapters.failure(broken) is not None)
    assert adapters.residency.operator_pins == frozenset() and adapters.stats().placements == ()
    assert not adapters.residency.pin(broken)       # the registry's next answer: refused while the failure is remembered
    assert disk.reads == ["broken"]
    del disk.broken[broken.sha256]
    clock.now += 11
    assert adapters.residency.pin(broken)
    poll_until(adapters, lambda: adapters.resident(broken) is not None)
    assert adapters.residency.operator_pins == {broken.sha256}


def test_the_order_book_follows_pins_exactly_and_preloads_once_per_order():
    disk = Disk()
    adapters, _ = manager(2, disk, host_slots=2)
    book = OrderBook(adapters.residency)
    a, b, c = ref("a"), ref("b"), ref("c")
    book.apply(PlacementOrders(pins=(a,), preloads=(Preload(b),)))
    poll_until(adapters, lambda: adapters.stats().gpu_adapters == ("a", "b"))
    assert _placed(adapters) == {"a": (Tier.GPU, False, True), "b": (Tier.GPU, False, False)}
    book.apply(PlacementOrders(pins=(a,), preloads=(Preload(b),)))  # the same answer again: nothing moves
    _use(adapters, c)                     # evicts the preload from both tiers (host room for two)
    assert adapters.stats().gpu_adapters == ("a", "c")
    book.apply(PlacementOrders(pins=(a,), preloads=(Preload(b),)))
    assert disk.reads == ["a", "b", "c"]  # carried out once: not loaded again
    book.apply(PlacementOrders(preloads=(Preload(b),)))  # the pin's order was lifted
    assert adapters.residency.operator_pins == frozenset() and _placed(adapters)["a"] == (Tier.GPU, False, False)
    book.apply(PlacementOrders(retire=(("c", c.sha256),)))
    assert "c" not in _placed(adapters)


def test_a_preload_refused_after_a_failed_load_is_carried_out_once_the_failure_expires():
    clock = Clock()
    disk = Disk()
    adapters, _ = manager(2, disk, clock=clock)
    book = OrderBook(adapters.residency)
    flaky = ref("flaky")
    disk.broken[flaky.sha256] = FailedPrecondition("checksum mismatch")
    book.apply(PlacementOrders(preloads=(Preload(flaky),)))
    poll_until(adapters, lambda: adapters.failure(flaky) is not None)
    book.apply(PlacementOrders(preloads=(Preload(flaky),)))  # the next answer: the failure is remembered, nothing read
    assert disk.reads == ["flaky"]
    del disk.broken[flaky.sha256]  # the files were repaired
    clock.now += 11
    book.apply(PlacementOrders(preloads=(Preload(flaky),)))  # the order stands: carried out now
    poll_until(adapters, lambda: adapters.resident(flaky) is not None)
    book.apply(PlacementOrders(preloads=(Preload(flaky),)))
    assert disk.reads == ["flaky", "flaky"]


def test_the_order_book_retires_a_pinned_deleted_adapter():
    disk = Disk()
    adapters, _ = manager(2, disk)
    book = OrderBook(adapters.residency)
    a = ref("a")
    book.apply(PlacementOrders(pins=(a,)))
    poll_until(adapters, lambda: adapters.resident(a) is not None)
    adapters.arrive(a)                    # a request in flight as the adapter is deleted
    book.apply(PlacementOrders(retire=(("a", a.sha256),)))  # the order went with the adapter
    assert adapters.residency.operator_pins == frozenset() and adapters.resident(a) is not None
    adapters.depart(a)
    stats = adapters.stats()
    assert stats.placements == () and (stats.gpu_versions, stats.host_versions) == (0, 0)


def test_placements_list_every_version_under_each_name():
    disk = Disk()
    adapters, _ = manager(2, disk)
    v0, v1 = ref("sql", 0), ref("sql", 1)
    adapters.arrive(v0)
    poll_until(adapters, lambda: adapters.resident(v0) is not None)
    disk.hold(v1)
    adapters.arrive(v1)                   # a new version while v0's request runs
    placements = {(p.sha256, p.newest): (p.tier, p.loading) for p in adapters.stats().placements}
    assert placements == {(v0.sha256, False): (Tier.GPU, False), (v1.sha256, True): (Tier.DISK, True)}
    assert adapters.stats().loading_adapters == ("sql",) and adapters.stats().gpu_adapters == ()
    disk.release(v1)
    poll_until(adapters, lambda: adapters.resident(v1) is not None)
    assert AdapterPlacement("sql", v1.sha256, Tier.GPU, False, False, True) in adapters.stats().placements


def test_a_host_preload_reads_into_host_memory_only_and_a_request_takes_it_on_to_the_gpu():
    disk = Disk()
    adapters, _ = manager(2, disk)
    warm = ref("warm")
    disk.hold(warm)
    assert adapters.residency.preload_host(warm)
    assert _placed(adapters) == {"warm": (Tier.DISK, True, False)}  # on its way from disk
    disk.release(warm)
    poll_until(adapters, lambda: _placed(adapters)["warm"] == (Tier.HOST, False, False))
    for _ in range(5):
        adapters.poll()
    assert adapters.resident(warm) is None and adapters.stats().gpu_versions == 0  # never copied to the GPU
    assert adapters.residency.preload_host(warm) and disk.reads == ["warm"]  # again: a no-op, no second read
    _use(adapters, warm)  # a request copies it from host memory, no disk read
    assert disk.reads == ["warm"] and _placed(adapters)["warm"][0] is Tier.GPU


def test_the_order_book_carries_out_host_preloads_and_a_gpu_preload_of_the_same_version_wins():
    disk = Disk()
    adapters, _ = manager(2, disk)
    book = OrderBook(adapters.residency)
    warm, hot = ref("warm"), ref("hot")
    book.apply(PlacementOrders(host_preloads=(Preload(warm), Preload(hot)), preloads=(Preload(hot),)))
    poll_until(adapters, lambda: adapters.resident(hot) is not None and _placed(adapters)["warm"][1] is False)
    assert _placed(adapters)["warm"][0] is Tier.HOST and adapters.resident(warm) is None


def test_a_planned_preload_is_declined_while_every_adapter_it_would_displace_is_hotter():
    """A placement plan's preload carries the rate it expects: it displaces only adapters whose requests
    were rarer (here LRU: longer ago than its expected gap), is then kept like an adapter requested at
    that rate, and is tried again at the next answer when declined."""
    clock = Clock()
    disk = Disk()
    adapters, _ = manager(2, disk, host_slots=2, clock=clock)
    book = OrderBook(adapters.residency)
    a, b, planned = ref("a"), ref("b"), ref("planned")
    _use(adapters, a)
    clock.now = 8.0
    _use(adapters, b)
    clock.now = 10.0
    book.apply(PlacementOrders(preloads=(Preload(planned, rate=0.1),)))  # as if last requested at 0: a is not colder
    assert adapters.stats().gpu_adapters == ("a", "b") and disk.reads == ["a", "b"]
    clock.now = 11.0
    book.apply(PlacementOrders(preloads=(Preload(planned, rate=0.2),)))  # the next answer, a higher rate: a goes
    poll_until(adapters, lambda: adapters.resident(planned) is not None)
    assert adapters.stats().gpu_adapters == ("b", "planned") and disk.reads == ["a", "b", "planned"]
    clock.now = 12.0
    _use(adapters, a)  # a request's load: the colder of b (at 8) and planned (expected at 6) goes
    assert adapters.stats().gpu_adapters == ("a", "b")


def test_an_operators_preload_still_displaces_whatever_is_coldest():
    disk = Disk()
    adapters, _ = manager(1, disk, host_slots=1)
    a, pre = ref("a"), ref("pre")
    _use(adapters, a)
    assert adapters.residency.preload(pre)  # rate 0: no comparison
    poll_until(adapters, lambda: adapters.resident(pre) is not None)
    assert adapters.stats().gpu_adapters == ("pre",)


def test_a_planned_preload_waits_while_a_requests_load_is_in_flight_and_runs_one_at_a_time():
    """Placement is background work: a plan's preload starts only while no other load is in flight or
    waited for, so it never delays a request's adapter and never runs beside another preload."""
    disk = Disk()
    adapters, _ = manager(4, disk)
    book = OrderBook(adapters.residency)
    wanted, first, second = ref("wanted"), ref("first"), ref("second")
    disk.hold(wanted)
    adapters.arrive(wanted)               # a request's load, held on disk
    orders = PlacementOrders(preloads=(Preload(first, rate=1.0), Preload(second, rate=1.0)))
    book.apply(orders)
    assert disk.reads == ["wanted"]       # both declined: the request's load comes first
    disk.release(wanted)
    poll_until(adapters, lambda: adapters.resident(wanted) is not None)
    book.apply(orders)                    # the next answer: one of them starts, the other waits for it
    poll_until(adapters, lambda: len(adapters.stats().gpu_adapters) == 2)
    assert disk.reads == ["wanted", "first"]
    book.apply(orders)
    poll_until(adapters, lambda: adapters.stats().gpu_adapters == ("first", "second", "wanted"))
    book.apply(orders)                    # both carried out: nothing more
    assert disk.reads == ["wanted", "first", "second"]
    adapters.depart(wanted)
