"""The engine's stats snapshot: load as the gateway prices it, and a text model's empty image cache."""

from __future__ import annotations

from gpu_worker.block_manager import BlockManager
from policy.cold_start import ColdStartPolicy
from gpu_worker.scheduler import Scheduler, SchedulerLimits
from gpu_worker.sequence import SamplingParams, Sequence
from gpu_worker.stats import SeqLoad, snapshot
from gpu_worker.vision.image_cache import ImageFeatureCache

from .adapter_fakes import Disk, manager, poll_until, ref


def _scheduler(max_num_seqs: int) -> Scheduler:
    adapters, _ = manager(2, Disk())
    return Scheduler(SchedulerLimits(max_num_seqs, max_batch_tokens=64), BlockManager(9, 4), adapters,
                     ColdStartPolicy("auto", tpot_slo_s=0.2))


def test_running_sequences_count_their_context_and_waiting_ones_their_prompt():
    scheduler = _scheduler(max_num_seqs=1)
    sql = ref("sql", rank=2)
    scheduler.add(Sequence("running", [1] * 6, SamplingParams(), sql, None))
    scheduler.add(Sequence("waiting", [1] * 3, SamplingParams(), None, None))
    poll_until(scheduler.adapters, lambda: scheduler.adapters.resident(sql) is not None)
    scheduler.schedule()  # admits the first only: max_num_seqs=1
    stats = snapshot(scheduler, scheduler.adapters, None, generated_tokens_total=0, busy_seconds_total=0.0)
    assert (stats.running_requests, stats.waiting_requests, stats.running_ranks) == (1, 1, (2,))
    assert stats.running_load == (SeqLoad("sql", 2, 6),) and stats.waiting_load == (SeqLoad(None, 0, 3),)
    assert (stats.resident_adapters, stats.adapter_slots, stats.pinned_adapters) == (("sql",), 2, 1)
    assert stats.adapters.gpu_adapters == ("sql",) and stats.adapters.gpu_capacity_bytes > 0
    assert stats.free_kv_tokens == (8 - 2) * 4  # two of the eight usable 4-token blocks hold the prompt


def test_a_text_model_reports_an_empty_image_cache_and_a_vision_model_its_own():
    scheduler = _scheduler(max_num_seqs=4)
    text = snapshot(scheduler, scheduler.adapters, None, generated_tokens_total=5, busy_seconds_total=0.0)
    assert (text.image_cache_entries, text.image_cache_capacity_bytes, text.generated_tokens_total) == (0, 0, 5)
    cache = ImageFeatureCache(1024)
    cache.get(("unseen", ""))  # (image digest, no tower adapter)
    vision = snapshot(scheduler, scheduler.adapters, cache, generated_tokens_total=5, busy_seconds_total=0.0)
    assert (vision.image_cache_misses_total, vision.image_cache_capacity_bytes) == (1, 1024)
