"""services/common/scheduling/adapter_tiers.py: frequency-driven eviction with decay, LRU for comparison,
pins, the inclusive host tier, and load costs by tier."""

from __future__ import annotations

import pytest

from services.common.scheduling.adapter_tiers import AdapterCache, LoadCosts, Tier
from services.common.scheduling.eviction import LRU, LFUDecay


def fill(cache: AdapterCache, adapters: list[str], now: float = 0.0) -> None:
    for a in adapters:
        cache.touch(a, now)
        assert cache.admit_to_gpu(a, 8) is not None


def test_lfu_evicts_the_least_frequent_not_the_least_recent() -> None:
    cache = AdapterCache(gpu_slots=3, host_slots=10, eviction=LFUDecay(half_life_s=1e6))
    fill(cache, ["hot", "b", "c"])
    for t in range(1, 6):
        cache.touch("hot", t)     # hot: 6 accesses, all early
    cache.touch("b", 10)
    cache.touch("c", 11)          # b and c: 2 accesses each, later than hot's
    cache.touch("c", 12)
    cache.touch("new", 13)
    assert cache.admit_to_gpu("new", 8) is Tier.DISK
    assert cache.gpu_adapters == {"hot", "c", "new"}  # b (2 accesses, older than c's third) left
    assert cache.tier("b") is Tier.HOST               # its host copy stays
    assert cache.evictions == 1


def test_lru_evicts_the_least_recent_whatever_its_frequency() -> None:
    cache = AdapterCache(gpu_slots=3, host_slots=10, eviction=LRU())
    fill(cache, ["hot", "b", "c"])
    for t in range(1, 6):
        cache.touch("hot", t)
    cache.touch("b", 10)
    cache.touch("c", 11)
    cache.touch("new", 13)
    cache.admit_to_gpu("new", 8)
    assert "hot" not in cache.gpu_adapters


def test_decay_lets_a_recently_warm_adapter_outrank_one_hot_long_ago() -> None:
    cache = AdapterCache(gpu_slots=2, host_slots=10, eviction=LFUDecay(half_life_s=10.0))
    cache.touch("old", 0.0)
    for _ in range(20):
        cache.touch("old", 0.0)   # 21 accesses at t=0: 21 / 2^10 ≈ 0.02 left at t=100
    cache.admit_to_gpu("old", 8)
    cache.touch("warm", 95.0)     # one access 5 s ago: 0.7 left
    cache.admit_to_gpu("warm", 8)
    cache.touch("new", 100.0)
    cache.admit_to_gpu("new", 8)
    assert cache.gpu_adapters == {"warm", "new"}


def test_pinned_adapters_are_never_evicted() -> None:
    cache = AdapterCache(gpu_slots=2, host_slots=4, eviction=LFUDecay(60.0))
    fill(cache, ["a", "b"])
    cache.pin("a")
    cache.pin("b")
    cache.touch("c", 1.0)
    assert cache.admit_to_gpu("c", 8) is None      # every slot held: the caller waits
    assert cache.gpu_adapters == {"a", "b"}
    cache.unpin("b")
    assert cache.admit_to_gpu("c", 8) is Tier.DISK
    assert cache.gpu_adapters == {"a", "c"}
    with pytest.raises(AssertionError):
        cache.unpin("b")


def test_host_tier_is_inclusive_and_evicts_only_host_only_adapters() -> None:
    cache = AdapterCache(gpu_slots=2, host_slots=3, eviction=LFUDecay(60.0))
    fill(cache, ["a", "b"])
    assert cache.host_adapters == {"a", "b"}         # GPU adapters keep a host copy
    cache.touch("a", 1.0)
    fill(cache, ["c"], now=2.0)                       # GPU full: b (fewest accesses) -> host only
    assert (cache.tier("b"), cache.tier("c")) == (Tier.HOST, Tier.GPU)
    cache.touch("a", 3.0)
    cache.touch("c", 3.0)
    fill(cache, ["d"], now=4.0)                       # host full too: b is the only host-only adapter
    assert cache.tier("b") is Tier.DISK
    assert cache.host_adapters == {"a", "c", "d"}


def test_a_host_copy_loads_from_host_and_staging_never_evicts() -> None:
    cache = AdapterCache(gpu_slots=1, host_slots=2, eviction=LFUDecay(60.0))
    assert cache.stage_in_host("x") and cache.stage_in_host("y")
    assert not cache.stage_in_host("z")               # full: not placed, nothing evicted
    assert cache.tier("z") is Tier.DISK
    cache.touch("x", 0.0)
    assert cache.admit_to_gpu("x", 8) is Tier.HOST


def test_tier_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="gpu_slots <= host_slots"):
        AdapterCache(gpu_slots=4, host_slots=2, eviction=LRU())


def test_load_costs_order_tiers_and_grow_with_rank() -> None:
    costs = LoadCosts()
    assert costs.load_s(Tier.GPU, 128) == 0.0
    for rank in (8, 64):
        assert 0 < costs.load_s(Tier.HOST, rank) < costs.load_s(Tier.DISK, rank)
        assert costs.load_s(Tier.DISK, rank) < costs.load_s(Tier.DISK, 2 * rank)
    assert costs.adapter_bytes(64) == 4 * 2 * 4096 * 64 * 2 * 32   # q,k,v,o of a 7B, bf16
