"""kernels.tuner.workload on CPU: the batches hit their bucket on disjoint slots, the correctness guard
in Triton's interpreter, and the rotating copies."""

from __future__ import annotations

import pytest
import torch

from kernels import tiling
from kernels.tiling import Bucket
from kernels.triton import lora_shrink as triton_shrink
from kernels.tuner.batches import batch_shapes
from kernels.tuner.search import CheckFailed
from kernels.tuner.workload import MAX_COPIES, MEMORY_CAP, Workload, copy_bytes, rotation_copies


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_workload_batches_hit_their_bucket_on_disjoint_slots(op):
    bucket = Bucket(op, 64, (32, 16), 16, 32, 8)
    work = Workload.build(bucket, copies=6, dtype=torch.float32, device="cpu")
    shapes = batch_shapes(bucket)  # spread 8, 4, 6, 2, 8, 4; random sizes twice; 4 x 8; 16 x 2
    assert len(shapes) == 5 and len(shapes[1].lens) == len(shapes[2].lens) == 12  # 32 - 8 + 1 groups at most
    assert shapes[3].lens == [8] * 4 and shapes[4].lens == [2] * 16  # even: the fewest groups, the most
    groups = 16  # slots a copy takes: the most any shape has
    assert work.stack.num_slots == 6 * groups and len(work.batches) == 6
    slots = [set(b.seg_slots) for b in work.batches]
    assert [len(s) for s in slots] == [len(shapes[c % 5].lens) for c in range(6)]
    assert all(min(s) >= c * groups and max(s) < (c + 1) * groups for c, s in enumerate(slots))  # disjoint
    assert all(tiling.bucket_of(op, work.stack, b) == bucket for b in work.batches)
    assert all(b.capacity == groups for b in work.batches)  # one compiled kernel, one grid
    assert [sorted(b.lens.tolist(), reverse=True) for b in work.batches] == [  # copies take the shapes in turn
        sorted(shapes[c % 5].lens, reverse=True) + [0] * (groups - len(shapes[c % 5].lens)) for c in range(6)]
    assert work.stack.host_ranks == [[r, r] for c in range(6)
                                     for r in [*shapes[c % 5].ranks, *[0] * (groups - len(shapes[c % 5].ranks))]]
    assert work.stack.ranks.tolist() == work.stack.host_ranks


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_check_passes_the_heuristic_in_the_interpreter(op):
    bucket = Bucket(op, 64, (32, 16), 16, 32, 8)
    Workload.build(bucket, copies=2, dtype=torch.float32, device="cpu").check(tiling.heuristic_config(bucket))


def test_check_ignores_y_past_each_adapters_rank(monkeypatch):
    bucket = Bucket("shrink", 64, (32, 16), 16, 32, 8)
    work = Workload.build(bucket, copies=3, dtype=torch.float32, device="cpu")  # the third: mixed ranks
    real = triton_shrink.lora_shrink

    def garbage_past_rank(x, stack, batch, *rest):  # lora_shrink leaves those entries unspecified
        y = real(x, stack, batch, *rest)
        for start, n, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
            y[:, start:start + n, :, stack.host_ranks[slot][0]:] = 1e6
        return y

    monkeypatch.setattr(triton_shrink, "lora_shrink", garbage_past_rank)
    assert set(batch_shapes(bucket)[2].ranks) == {16, 8, 4, 2}
    work.check(tiling.heuristic_config(bucket))


def test_check_covers_every_batch_shape(monkeypatch):
    bucket = Bucket("shrink", 64, (32, 16), 16, 32, 8)
    work = Workload.build(bucket, copies=2, dtype=torch.float32, device="cpu")
    real = triton_shrink.lora_shrink
    monkeypatch.setattr(triton_shrink, "lora_shrink",  # wrong on the random-size batch only
                        lambda x, stack, batch, *rest: real(x, stack, batch, *rest) * (1.01 if batch is work.batches[1] else 1))
    with pytest.raises(CheckFailed, match="batch shape 1"):
        work.check(tiling.heuristic_config(bucket))


def test_check_catches_a_broken_kernel(monkeypatch):
    bucket = Bucket("shrink", 64, (32, 16), 16, 8, 8)
    work = Workload.build(bucket, copies=1, dtype=torch.float32, device="cpu")
    real = triton_shrink.lora_shrink
    monkeypatch.setattr(triton_shrink, "lora_shrink", lambda *args: real(*args) * 1.01)
    with pytest.raises(CheckFailed, match="off the reference"):
        work.check(tiling.heuristic_config(bucket))

    def fail(*args):
        raise RuntimeError("no smem")

    monkeypatch.setattr(triton_shrink, "lora_shrink", fail)
    with pytest.raises(CheckFailed, match="no smem"):
        work.check(tiling.heuristic_config(bucket))


def test_rotation_copies_span_l2_under_the_memory_cap():
    decode = Bucket("shrink", 4096, (4096,), 16, 1, 1)
    moved, allocated = copy_bytes(decode, 2)
    assert moved == 4096 * 2 + 16 * 4096 * 2 + 16 * 2  # x, A of one slot, y (one plane: the model's dtype)
    assert copy_bytes(decode, 2, splits=4)[0] == 4096 * 2 + 16 * 4096 * 2 + 4 * 16 * 4  # float32 planes
    assert allocated == 4096 * 2 + 16 * 4096 * 2 + 4096 * 16 * 2  # x and the whole slot
    assert rotation_copies(decode, 2, needed=lambda n: 3 * 50 * 2**20 // n + 1) == MAX_COPIES  # capped
    assert rotation_copies(decode, 2, needed=lambda n: 7) == 7  # one batch shape (one-token groups)
    assert rotation_copies(Bucket("shrink", 4096, (4096,), 16, 512, 128), 2, needed=lambda n: 7) == 35  # 5 shapes
    prefill = Bucket("expand", 18944, (3584,), 128, 8192, 32)  # 256 slots of 128 x (18944 + 3584) each
    copies = rotation_copies(prefill, 2, needed=lambda n: 10**6)
    assert copies == MEMORY_CAP // copy_bytes(prefill, 2)[1] and copies * copy_bytes(prefill, 2)[1] <= MEMORY_CAP
    assert rotation_copies(prefill, 2, needed=lambda n: 1) == min(5, copies)  # each of its 5 shapes, if it can
