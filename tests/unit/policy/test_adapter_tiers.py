"""policy/adapter_tiers.py: byte-budgeted GPU and host tiers with frequency-driven
eviction (with decay), LRU for comparison, pins, the inclusive host tier, and load costs by tier."""

from __future__ import annotations

import pytest

from policy.adapter_tiers import AdapterTiers, LoadCosts, Tier
from policy.eviction import LRU, LFUDecay

MB = 1 << 20


def load(tiers: AdapterTiers, adapter: str, nbytes: int = 8 * MB, now: float = 0.0) -> list[str]:
    """A request's way: touch, host (from disk) if needed, then GPU; -> adapters evicted from the GPU."""
    tiers.touch(adapter, now)
    if tiers.tier(adapter) is Tier.DISK:
        assert tiers.place_in_host(adapter, nbytes) is not None
    victims = tiers.place_on_gpu(adapter)
    assert victims is not None
    return victims


def test_lfu_evicts_the_least_frequent_not_the_least_recent() -> None:
    tiers = AdapterTiers(gpu_bytes=24 * MB, host_bytes=100 * MB, eviction=LFUDecay(half_life_s=1e6))
    for a in ("hot", "b", "c"):
        load(tiers, a)
    for t in range(1, 6):
        tiers.touch("hot", t)     # hot: 6 accesses, all early
    tiers.touch("b", 10)
    tiers.touch("c", 11)          # b and c: 2 accesses each, later than hot's
    tiers.touch("c", 12)
    assert load(tiers, "new", now=13) == ["b"]  # 2 accesses, older than c's third
    assert tiers.gpu_adapters == {"hot", "c", "new"}
    assert tiers.tier("b") is Tier.HOST         # its host copy stays
    assert tiers.evictions[Tier.GPU] == 1


def test_lru_evicts_the_least_recent_whatever_its_frequency() -> None:
    tiers = AdapterTiers(gpu_bytes=24 * MB, host_bytes=100 * MB, eviction=LRU())
    for a in ("hot", "b", "c"):
        load(tiers, a)
    for t in range(1, 6):
        tiers.touch("hot", t)
    tiers.touch("b", 10)
    tiers.touch("c", 11)
    assert load(tiers, "new", now=13) == ["hot"]


def test_decay_lets_a_recently_warm_adapter_outrank_one_hot_long_ago() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=100 * MB, eviction=LFUDecay(half_life_s=10.0))
    for _ in range(20):
        tiers.touch("old", 0.0)   # 21 accesses at t=0: 21 / 2^10 ≈ 0.02 left at t=100
    load(tiers, "old")
    load(tiers, "warm", now=95.0)  # one access 5 s ago: 0.7 left
    load(tiers, "new", now=100.0)
    assert tiers.gpu_adapters == {"warm", "new"}


def test_budgets_are_bytes_so_small_ranks_pack_many_to_the_space_of_one_large() -> None:
    tiers = AdapterTiers(gpu_bytes=64 * MB, host_bytes=128 * MB, eviction=LFUDecay(60.0))
    load(tiers, "rank64", nbytes=64 * MB)
    assert load(tiers, "rank8-0", nbytes=8 * MB) == ["rank64"]  # the big one must leave for any other
    for i in range(1, 8):
        assert load(tiers, f"rank8-{i}", nbytes=8 * MB, now=i) == []  # eight rank-8s share its space
    assert tiers.gpu_used == 64 * MB and len(tiers.gpu_adapters) == 8
    assert tiers.host_used == 128 * MB


def test_pinned_adapters_are_never_evicted() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=32 * MB, eviction=LFUDecay(60.0))
    load(tiers, "a")
    load(tiers, "b")
    tiers.pin("a")
    tiers.pin("b")
    tiers.touch("c", 1.0)
    assert tiers.place_in_host("c", 8 * MB) == []
    assert tiers.place_on_gpu("c") is None           # every byte held: the caller waits
    assert tiers.gpu_adapters == {"a", "b"}
    tiers.unpin("b")
    assert tiers.place_on_gpu("c") == ["b"]
    assert tiers.gpu_adapters == {"a", "c"}
    with pytest.raises(AssertionError):
        tiers.unpin("b")


def test_host_tier_is_inclusive_and_evicts_host_only_adapters_first() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=24 * MB, eviction=LFUDecay(60.0))
    load(tiers, "a")
    load(tiers, "b")
    assert tiers.host_adapters == {"a", "b"}          # GPU adapters keep a host copy
    tiers.touch("a", 1.0)
    load(tiers, "c", now=2.0)                          # GPU full: b (fewest accesses) -> host only
    assert (tiers.tier("b"), tiers.tier("c")) == (Tier.HOST, Tier.GPU)
    tiers.touch("d", 3.0)
    assert tiers.place_in_host("d", 8 * MB) == ["b"]   # host full: b, host-only, goes; a and c stay
    assert tiers.tier("b") is Tier.DISK and tiers.gpu_adapters == {"a", "c"}


def test_a_gpu_adapter_leaves_both_tiers_only_when_host_only_ones_are_not_enough() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=16 * MB, eviction=LRU())
    load(tiers, "a")
    load(tiers, "b", now=1.0)
    tiers.touch("c", 2.0)
    assert tiers.place_in_host("c", 8 * MB) == ["a"]
    assert tiers.tier("a") is Tier.DISK and tiers.evictions == {Tier.GPU: 1, Tier.HOST: 1}


def test_preloaded_adapters_nobody_requested_go_first_and_drop_forgets() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=32 * MB, eviction=LFUDecay(60.0))
    assert tiers.place_in_host("staged", 8 * MB) == []  # placed without a request: no record
    load(tiers, "used")
    tiers.touch("new", 1.0)
    assert tiers.place_in_host("new", 24 * MB) == ["staged"]
    tiers.drop("used")
    assert tiers.tier("used") is Tier.DISK and tiers.gpu_used == 0 and tiers.host_used == 24 * MB
    assert not tiers.fits(17 * MB) and tiers.fits(16 * MB)


def test_a_host_tier_smaller_than_the_gpu_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="host"):
        AdapterTiers(gpu_bytes=2 * MB, host_bytes=MB, eviction=LRU())


def test_load_costs_rank_with_tier() -> None:
    costs = LoadCosts()
    assert costs.load_s(Tier.GPU, 64) == 0.0
    assert 0 < costs.load_s(Tier.HOST, 64) < costs.load_s(Tier.DISK, 64)
    assert costs.load_s(Tier.HOST, 128) > costs.load_s(Tier.HOST, 8)
    # From disk: read + verify at 1.5 GB/s after 20 ms, then the copy at 25 GB/s after 0.5 ms.
    nbytes = 64 * 2 * MB
    assert costs.load_s(Tier.DISK, 64) == pytest.approx(20e-3 + nbytes / 1.5e9 + 0.5e-3 + nbytes / 25e9)


def test_staging_places_only_into_free_host_memory() -> None:
    tiers = AdapterTiers(gpu_bytes=8 * MB, host_bytes=16 * MB, eviction=LFUDecay(60.0))
    assert tiers.stage_in_host("x", 8 * MB) and tiers.stage_in_host("y", 8 * MB)
    assert not tiers.stage_in_host("z", 8 * MB)       # full: not placed, nothing evicted
    assert tiers.tier("z") is Tier.DISK
    tiers.touch("x", 0.0)
    assert tiers.place_on_gpu("x") == [] and tiers.tier("x") is Tier.GPU


def test_load_costs_grow_with_rank() -> None:
    costs = LoadCosts()
    for rank in (8, 64):
        assert costs.load_s(Tier.DISK, rank) < costs.load_s(Tier.DISK, 2 * rank)
    assert costs.adapter_bytes(64) == 4 * 2 * 4096 * 64 * 2 * 32   # q,k,v,o of a 7B, bf16


def test_a_seat_limit_evicts_even_when_bytes_would_fit() -> None:
    tiers = AdapterTiers(gpu_bytes=64 * MB, host_bytes=128 * MB, eviction=LRU(), gpu_max_adapters=2)
    load(tiers, "a", nbytes=MB)
    load(tiers, "b", nbytes=MB, now=1.0)
    assert load(tiers, "c", nbytes=MB, now=2.0) == ["a"]   # 62 MB free, but no seat
    tiers.pin("b")
    tiers.pin("c")
    tiers.touch("d", 3.0)
    tiers.place_in_host("d", MB)
    assert tiers.place_on_gpu("d") is None                 # both seats held


def test_resize_corrects_a_reservation_to_the_true_size() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=32 * MB, eviction=LRU())
    tiers.touch("a", 0.0)
    tiers.place_in_host("a", 16 * MB)   # the most any adapter can take, before its read
    tiers.resize("a", 2 * MB)
    assert tiers.host_used == 2 * MB and tiers.place_on_gpu("a") == [] and tiers.gpu_used == 2 * MB


@pytest.mark.parametrize("eviction", [LFUDecay(half_life_s=60.0), LRU()], ids=["lfu", "lru"])
def test_a_planned_rate_displaces_only_colder_adapters(eviction) -> None:
    """A placement plan's preload is weighed by the rate it expects: room for it is made only of adapters
    whose own records are colder than steady requests at that rate."""
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=16 * MB, eviction=eviction)
    for t in range(20):  # hot: a request every second
        tiers.touch("hot", float(t))
    load(tiers, "hot", now=20.0)
    load(tiers, "once", now=0.0)  # one request, 20 s ago
    tiers.expect("planned", rate=0.2, now=20.0)
    assert tiers.room_for("planned", Tier.HOST, 8 * MB) and tiers.room_for("planned", Tier.GPU, 8 * MB)
    tiers.expect("rare", rate=0.001, now=20.0)  # colder than both
    assert not tiers.room_for("rare", Tier.HOST, 8 * MB) and not tiers.room_for("rare", Tier.GPU, 8 * MB)
    tiers.expect("hot", rate=0.001, now=20.0)  # an expectation never lowers what requests recorded
    assert not tiers.room_for("planned", Tier.GPU, 16 * MB)  # it would need hot's room too
    assert tiers.place_in_host("planned", 8 * MB) == ["once"]  # the room `room_for` counted on


def test_a_planned_adapter_is_kept_like_one_requested_at_its_rate() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=100 * MB, eviction=LFUDecay(half_life_s=60.0))
    tiers.expect("planned", rate=1.0, now=0.0)  # never requested here, expected at 1/s
    assert tiers.place_in_host("planned", 8 * MB) == [] and tiers.place_on_gpu("planned") == []
    load(tiers, "one-off", now=1.0)
    assert load(tiers, "another", now=2.0) == ["one-off"]  # not the planned adapter


@pytest.mark.parametrize("eviction", [LFUDecay(half_life_s=60.0), LRU()], ids=["lfu", "lru"])
def test_a_records_rate_reads_back_the_rate_it_was_expected_at(eviction) -> None:
    for rate in (0.01, 0.5, 4.0):
        assert eviction.rate(eviction.expected(rate, now=100.0), now=100.0) == pytest.approx(rate)


def test_an_lfu_rate_decays_with_the_half_life_and_an_lru_one_with_the_gap() -> None:
    lfu, lru = LFUDecay(half_life_s=60.0), LRU()
    assert lfu.rate(lfu.expected(1.0, now=0.0), now=60.0) == pytest.approx(0.5)  # a half-life without requests
    assert lru.rate(lru.touched(None, now=0.0), now=20.0) == pytest.approx(1 / 20)
    assert lru.rate(lru.touched(None, now=5.0), now=5.0) > 0  # just touched: high, finite


def test_the_gpu_victim_rate_is_the_coldest_unpinned_adapters_once_the_tier_is_full() -> None:
    tiers = AdapterTiers(gpu_bytes=16 * MB, host_bytes=64 * MB, eviction=LFUDecay(half_life_s=60.0))
    assert tiers.gpu_victim_rate(now=0.0) == 0.0  # empty
    for t in range(10):
        tiers.touch("hot", float(t))
    load(tiers, "hot", now=10.0)
    assert tiers.gpu_victim_rate(now=10.0) == 0.0  # room for another of its size: a miss evicts nothing
    load(tiers, "once", now=10.0)
    once = LFUDecay(half_life_s=60.0).rate((1.0, 10.0), now=40.0)
    assert tiers.gpu_victim_rate(now=40.0) == pytest.approx(once)  # full: "once" leaves first
    tiers.pin("once")
    assert tiers.gpu_victim_rate(now=40.0) > once  # pinned: "hot" would leave instead
    tiers.pin("hot")
    assert tiers.gpu_victim_rate(now=40.0) == 0.0  # nothing evictable: no victim to price


def test_a_seat_limit_makes_a_victim_though_bytes_are_free() -> None:
    tiers = AdapterTiers(gpu_bytes=64 * MB, host_bytes=64 * MB, eviction=LRU(), gpu_max_adapters=1)
    load(tiers, "a", now=0.0)
    assert tiers.gpu_victim_rate(now=10.0) == pytest.approx(0.1)
