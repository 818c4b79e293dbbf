"""The Triton kernels on a CUDA device in bfloat16 (the interpreter cannot run bf16), against the
float32 torch references on the same inputs: relative error ||out - ref|| / ||ref|| under 1e-2.
Run through the device tool: `python3 -m pytest -m gpu tests/gpu -q`."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import kernels
from kernels import NO_SLOT, LoRABatch, LoRAStack, reference
from kernels import paged_attention
from kernels.attention import AttentionMetadata, paged_attention_reference
from tests.unit.kernels.test_attention import CASES as ATTENTION_CASES
from tests.unit.kernels.test_attention import HEADS, _make_batch
from tests.unit.kernels.test_lora_reference import CASES as LORA_CASES
from tests.unit.kernels.test_lora_mixture import MERGED, MIX_SLOT, SEG_LENS, SEG_SLOTS
from tests.unit.kernels.test_lora_reference import LAYOUTS, make_batch, make_inputs, make_stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16_REL = 1e-2


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12)).item()


def _on_cuda(stack: LoRAStack, dtype: torch.dtype) -> LoRAStack:
    return stack.copy(dtype, "cuda")


def _lora_reference(stack, batch, x, out):
    y = reference.lora_shrink(x, stack, batch)
    expected = out.clone()
    reference.lora_expand(expected, y, stack, batch)
    return expected


@pytest.mark.parametrize("case", [c for c in sorted(LORA_CASES) if make_batch(c).has_lora])  # others: CPU tests
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_bf16_matches_float32_reference(case, layout):
    stack, _ = make_stack(layout, torch.float32)
    batch = make_batch(case)
    x, out = make_inputs(batch, stack.out_features, torch.float32)
    expected = _lora_reference(stack, batch, x.to(torch.bfloat16).float(), out.to(torch.bfloat16).float())
    cuda_stack = _on_cuda(stack, torch.bfloat16)
    cuda_batch = LoRABatch.build(batch.seg_lens, batch.seg_slots, "cuda", capacity=batch.capacity)
    actual = out.to("cuda", torch.bfloat16)
    y = kernels.lora_shrink(x.to("cuda", torch.bfloat16), cuda_stack, cuda_batch)
    kernels.lora_expand(actual, y, cuda_stack, cuda_batch)
    assert _rel_err(actual.cpu(), expected) < BF16_REL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_mixture_bf16_matches_float32_reference(layout):
    """A mixture batch (tests/unit/kernels/test_lora_mixture.py's) in bf16 on the device, every kernel the
    tables pick for it, against the float32 reference."""
    stack, _ = make_stack(layout, torch.float32)
    stack.mirror(MERGED, MIX_SLOT, -1.0)
    batch = LoRABatch.build(SEG_LENS, SEG_SLOTS, "cpu", mix_slot=MIX_SLOT)
    x, out = make_inputs(batch, stack.out_features, torch.float32)
    expected = _lora_reference(stack, batch, x.to(torch.bfloat16).float(), out.to(torch.bfloat16).float())
    cuda_stack = _on_cuda(stack, torch.bfloat16)

    cuda_batch = LoRABatch.build(SEG_LENS, SEG_SLOTS, "cuda", mix_slot=MIX_SLOT)
    actual = out.to("cuda", torch.bfloat16)
    y = kernels.lora_shrink(x.to("cuda", torch.bfloat16), cuda_stack, cuda_batch)
    kernels.lora_expand(actual, y, cuda_stack, cuda_batch)
    assert _rel_err(actual.cpu(), expected) < BF16_REL


def _captured_lora_step(cuda_stack: LoRAStack, static: LoRABatch):
    """A CUDA graph of out = base + LoRA(x) over `static` (8 tokens, bf16); -> (graph, x, out, base)."""
    x = torch.randn(8, cuda_stack.in_features, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8, cuda_stack.out_features, device="cuda", dtype=torch.bfloat16)
    base = torch.randn_like(out)

    def step():
        out.copy_(base)
        kernels.lora_expand(out, kernels.lora_shrink(x, cuda_stack, static), cuda_stack, static)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph, x, out, base


def test_lora_graph_replays_new_segments():
    """Captured with one segment table, replayed after another was copied in: the kernels read the
    device tables, so the replay computes the new batch."""
    stack, _ = make_stack("qkv", torch.float32)
    cuda_stack = _on_cuda(stack, torch.bfloat16)
    static = LoRABatch.build([2, 2, 2, 2], [0, NO_SLOT, 1, 2], "cuda", capacity=8, max_group_len=8)
    graph, x, out, base = _captured_lora_step(cuda_stack, static)
    live = LoRABatch.build([5, 1, 2], [2, 0, NO_SLOT], "cuda", capacity=8)
    live.copy_into(static)
    graph.replay()
    host_live = LoRABatch.build(live.seg_lens, live.seg_slots, "cpu")
    expected = _lora_reference(stack, host_live, x.float().cpu(), base.float().cpu())
    assert _rel_err(out.cpu(), expected) < BF16_REL


def test_lora_graph_replays_over_adapters_replaced_and_moved_after_capture():
    """The arena and the slot tables are allocated once and only their contents change: a graph captured
    before slot 0 got an adapter of other ranks and scalings, and before the arena was compacted under
    slots 1 and 4 (slot 2 freed), replays what is there now."""
    stack, _ = make_stack("qkv", torch.float32)
    cuda_stack = LoRAStack.standalone(stack.num_slots, stack.in_features, stack.out_sizes, stack.max_rank,
                                      torch.bfloat16, "cuda")
    for slot in range(stack.num_slots):
        if any(stack.host_ranks[slot]):
            cuda_stack.set_slot(slot, stack.slot_weights(slot), dict(enumerate(stack.host_scalings[slot])))
    segments = ([2, 2, 3, 1], [0, NO_SLOT, 1, 4])
    static = LoRABatch.build(*segments, "cuda", capacity=8, max_group_len=8)
    graph, x, out, base = _captured_lora_step(cuda_stack, static)
    g = torch.Generator().manual_seed(5)
    new = {s: (torch.randn(r, stack.in_features, generator=g) / stack.in_features ** 0.5,
               torch.randn(stack.out_sizes[s], r, generator=g)) for s, r in ((0, 16), (2, 4))}
    for target, device in ((stack, "cpu"), (cuda_stack, "cuda")):
        target.set_slot(0, {s: (a.to(device), b.to(device)) for s, (a, b) in new.items()}, {0: 0.5, 2: 1.5})
        target.reset_slot(2)
    assert cuda_stack.arena.compact()
    graph.replay()
    expected = _lora_reference(stack, LoRABatch.build(*segments, "cpu"), x.float().cpu(), base.float().cpu())
    assert _rel_err(out.cpu(), expected) < BF16_REL


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_paged_attention_bf16_matches_float32_reference(case, heads):
    batch = _make_batch(case, heads, 16, torch.float32)
    expected = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 32 ** -0.5)
    meta = AttentionMetadata(*(getattr(batch.meta, f).cuda() for f in
                               ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")),
                             max_query_len=batch.meta.max_query_len, max_seq_len=batch.meta.max_seq_len)
    actual = paged_attention(batch.q.to("cuda", torch.bfloat16), batch.k_cache.to("cuda", torch.bfloat16),
                             batch.v_cache.to("cuda", torch.bfloat16), meta, 32 ** -0.5)
    rows = batch.meta.query_start_loc[-1].item()  # rows past the last sequence are padding
    assert _rel_err(actual[:rows].float().cpu(), expected[:rows]) < BF16_REL


def test_paged_attention_long_prefill_head_dim_128():
    """One 1500-token prompt after a 300-token cached prefix, 8 query / 2 KV heads of dim 128,
    blocks of 16 in shuffled order: the shapes of a 7B-class prefill chunk."""
    torch.manual_seed(0)
    cached, new, heads, kv_heads, dim, block = 300, 1500, 8, 2, 128, 16
    num_blocks = -(-(cached + new) // block) + 1
    table = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(new, heads, dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(cached, cached + new)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, new], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([cached + new], dtype=torch.int32, device="cuda"),
        block_tables=table[None].cuda(),
        slot_mapping=(table[positions // block].long() * block + positions % block).cuda(),
        max_query_len=new, max_seq_len=cached + new)
    actual = paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    assert _rel_err(actual.float(), expected) < BF16_REL


@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("out_features,in_features", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)])
def test_skinny_linear_bf16_matches_float32(rows, out_features, in_features):
    """The decode matmul on the 7B projection shapes, with a bias (Qwen2's qkv has one)."""
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(out_features, device="cuda", dtype=torch.bfloat16)
    actual = kernels.linear(x, weight, bias)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert _rel_err(actual.float(), expected) < BF16_REL


def _merge_with_reference(layouts, dtype: torch.dtype, max_rank: int, rank: int):
    """Merge slot 1 into fresh weights, one launch, and the same with the torch reference.
    layouts: (in_features, out slice sizes, targeted slices) per projection.
    -> (targets, references, originals)."""
    from kernels import merge_weights
    from kernels.merge import MergeTarget, merge_weights_reference

    torch.manual_seed(0)
    targets, references, originals = [], [], []
    for in_features, sizes, targeted in layouts:
        stack = LoRAStack.standalone(2, in_features, sizes, max_rank, dtype, "cuda")
        stack.set_slot(1, {s: (torch.randn(rank, in_features, device="cuda", dtype=dtype) * 0.05,
                               torch.randn(sizes[s], rank, device="cuda", dtype=dtype) * 0.05)
                           for s in targeted}, 2.0)
        weight = torch.randn(sum(sizes), in_features, device="cuda", dtype=dtype)
        originals.append(weight.clone())
        targets.append(MergeTarget(weight, torch.empty_like(weight), stack))
        references.append(MergeTarget(weight.clone(), torch.empty_like(weight), stack))
    merge_weights(targets, 1)
    merge_weights_reference(references, 1)
    return targets, references, originals


def test_merge_one_launch_bf16_matches_reference_and_restores_exactly():
    from kernels import restore_weights

    layouts = ((4096, (4096, 1024, 1024), (0, 2)), (4096, (4096,), (0,)), (11008, (4096,), (0,)))
    targets, references, originals = _merge_with_reference(layouts, torch.bfloat16, 64, 64)
    for target, reference_, original in zip(targets, references, originals):
        delta, expected = (target.weight.float() - original.float()), (reference_.weight.float() - original.float())
        assert _rel_err(delta, expected) < BF16_REL
    restore_weights(targets)
    assert all(torch.equal(t.weight, o) for t, o in zip(targets, originals))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_features,max_rank", [(3584, 64), (1003, 8), (512, 4)],
                         ids=["aligned", "odd-columns", "b-stride-8-bytes"])
def test_merge_gqa_compiled_equals_reference_rounded_once(dtype, in_features, max_rank):
    """The compiled paths (16-byte hints or none, every dtype): a Qwen2-like fused qkv (q 3584, k and
    v 512 rows, k untargeted), an o of odd rows, ranks below the stack's padding; the result is the
    float32 reference rounded once, the backup and the restore bit-exact."""
    from kernels import restore_weights

    layouts = ((in_features, (3584, 512, 512), (0, 2)), (in_features, (1001,), (0,)))
    targets, references, originals = _merge_with_reference(layouts, dtype, max_rank, max_rank // 2)
    for target, reference_, original in zip(targets, references, originals):
        assert torch.equal(target.backup, original)
        actual, expected = target.weight.double(), reference_.weight.double()
        if dtype == torch.float32:
            assert _rel_err(actual - original.double(), expected - original.double()) < 1e-5
        else:  # one rounding of float32 sums: at most one unit in the last place apart
            ulp = torch.maximum(actual.abs(), expected.abs()) * torch.finfo(dtype).eps
            assert bool(((actual - expected).abs() <= ulp + 1e-6).all())
        if target.stack.num_slices > 1:  # k is untargeted: left as it is
            k_rows = slice(target.stack.out_offsets[1], target.stack.out_offsets[2])
            assert torch.equal(target.weight[k_rows], original[k_rows])
    restore_weights(targets)
    assert all(torch.equal(t.weight, o) for t, o in zip(targets, originals))


def _distinct_table_configs() -> list[tuple[str, object]]:
    from kernels import tiling
    table = tiling.table_for(torch.device("cuda")) if torch.cuda.is_available() else {"configs": {}}
    found = {(key.split("|")[0], tiling.config_from(key.split("|")[0], entry)) for key, entry in table["configs"].items()}
    return sorted(found, key=str)


def test_every_tuned_config_computes_the_reference():
    """Each distinct configuration this GPU runs from the committed tables (its own and its
    architecture's): a bad table entry cannot ship."""
    configs = _distinct_table_configs()
    if not configs:
        pytest.skip(f"no tuned table for {torch.cuda.get_device_name()}")
    _check_configs(configs)


def test_pipelined_expand_steps_compute_the_reference():
    """Expand's pipelined steps (out tiles prefetched through shared memory) in bf16, at each
    prefetch depth the tuner tries, with wgmma (64 rows) and mma (16 rows) tiles."""
    from kernels.tiling import ExpandConfig
    from kernels.tuner.candidates import PIPELINE_STAGES
    from tests.unit.kernels.test_lora_triton import RANK_CLASS_BATCH, rank_class_stack
    configs = [("expand", ExpandConfig(m, n, steps, warps, stages, pipeline=True))
               for m, n, steps, warps in [(64, 64, 4, 4), (16, 32, 8, 8), (32, 128, 2, 8)]
               for stages in PIPELINE_STAGES]
    _check_configs(configs)
    _check_configs(configs, rank_class_stack(torch.float32), *RANK_CLASS_BATCH)  # each rank class


def test_stationary_expand_steps_compute_the_reference():
    """B-stationary expands in bf16: every tile the tuner tries, each M span, on y as float32 planes
    and as one bf16 plane, on groups of several programs each (300 and 221 tokens) and in each rank class."""
    from kernels.tiling import ExpandConfig, ShrinkConfig
    from kernels.tuner.candidates import MAX_TILE, M_STEPS, PIPELINE_STAGES, STATIONARY_TILES
    from tests.unit.kernels.test_lora_triton import RANK_CLASS_BATCH, rank_class_stack
    configs = [("expand", ExpandConfig(m, n, 1, 8 if m * n >= MAX_TILE else 4, stages, m_steps=k))  # as tile_shapes
               for m, n in STATIONARY_TILES for k in M_STEPS for stages in PIPELINE_STAGES[:2]]
    long_groups = (300, 1, 5, 1, 200, 3, 1), (0, 1, 4, NO_SLOT, 1, 0, 2)
    for split in (1, 2):
        _check_configs(configs, None, *long_groups, shrink_config=ShrinkConfig(64, 64, split, 4, 3))
    _check_configs(configs, rank_class_stack(torch.float32), *RANK_CLASS_BATCH)


def _check_configs(configs: list[tuple[str, object]], stack: LoRAStack | None = None,
                   seg_lens: Sequence[int] = (37, 1, 5, 1, 20, 3, 1),
                   seg_slots: Sequence[int] = (0, 1, 4, NO_SLOT, 1, 0, 2), shrink_config: object = None) -> None:
    """Each (op, config) against the float32 reference, by default on a batch that gathers scattered
    tokens, mixes ranks and slices and leaves a slot out. Expands take y from `shrink_config` (None:
    the table's)."""
    stack = stack or make_stack("qkv", torch.float32)[0]
    cuda_stack = _on_cuda(stack, torch.bfloat16)
    batch = LoRABatch.build(seg_lens, seg_slots, "cuda")
    host = LoRABatch.build(seg_lens, seg_slots, "cpu")
    x, out = make_inputs(host, stack.out_features, torch.float32)
    x16, out16 = x.to(torch.bfloat16), out.to(torch.bfloat16)
    y_ref = reference.lora_shrink(x16.float(), stack, host)
    expected = out16.float().clone()
    reference.lora_expand(expected, y_ref, stack, host)
    from kernels.triton import lora_expand as triton_expand
    from kernels.triton import lora_shrink as triton_shrink
    for op, config in configs:
        actual = out16.cuda()
        shrink_cfg = config if op == "shrink" else shrink_config
        y = triton_shrink.lora_shrink(x16.cuda(), cuda_stack, batch, shrink_cfg)
        triton_expand.lora_expand(actual, y, cuda_stack, batch, config if op == "expand" else None)
        assert _rel_err(actual.cpu(), expected) < BF16_REL, (op, config)


def test_no_lora_kernel_compiles_after_warm_up():
    """After kernels.triton.lora_warmup, engine-like batches of any shape within the limits run without a
    single Triton compile (each would stall a serving step for ~0.3-1 s)."""
    import random

    from kernels.triton.compile_ahead import compiles_recorded, compiling_ahead
    from kernels.triton.lora_warmup import warm_up_lora
    from tests.unit.kernels.test_lora_warmup import random_batch

    max_tokens, slots, max_rank = 1024, 8, 64
    stacks = [LoRAStack.standalone(slots, 512, sizes, max_rank, torch.bfloat16, "cuda")
              for sizes in ((512, 128, 128), (512,))]
    with compiling_ahead():
        warm_up_lora(stacks, max_tokens, slots)
    with compiles_recorded() as compiled:
        rng = random.Random(0)
        for _ in range(200):
            batch = random_batch(rng, max_tokens, slots, max_rank)
            batch = LoRABatch.build(batch.seg_lens, batch.seg_slots, "cuda", max_rank=batch.max_rank)
            for stack in stacks:
                x = torch.randn(batch.num_tokens, stack.in_features, device="cuda", dtype=torch.bfloat16)
                out = torch.zeros(batch.num_tokens, stack.out_features, device="cuda", dtype=torch.bfloat16)
                kernels.lora_expand(out, kernels.lora_shrink(x, stack, batch), stack, batch)
        torch.cuda.synchronize()
    assert compiled == []
