"""A task head and tower LoRA packed after an adapter's LoRA parts: read back in place from the GPU tier's arena
(`head`, `tower`) and from the host copy (`host_tower`, what the CPU-assisted path takes), equal to the loaded
tensors, across scattered host pages."""

from __future__ import annotations

import torch

import kernels
from gpu_worker.lora.gpu_memory import GpuAdapterMemory
from gpu_worker.lora.host_weights import HostPages
from gpu_worker.lora.layer import LoRALinear
from gpu_worker.lora.loader import HeadWeights, LoRAModule, LoRAWeights, TowerWeights
from services.common.task_heads import TaskHead
from services.common.tower_lora import TowerLoraModule, TowerLoraSpec

from .adapter_fakes import IN, MAX_RANK, OUT

TOWER = TowerLoraSpec((TowerLoraModule("model.visual.blocks.0.attn.qkv", 2, 1.5, 12, 36),))
HEAD = TaskHead("mlp", ("a", "b", "c"), (("task_head.fc1.weight", (5, IN)), ("task_head.fc1.bias", (5,)),
                                        ("task_head.fc2.weight", (3, 5)), ("task_head.fc2.bias", (3,))))


def _weights(generator: torch.Generator) -> LoRAWeights:
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)
    tower = TowerWeights(TOWER, {name: draw(*shape) for name, shape in TOWER.tensors})
    head = HeadWeights(HEAD, {name: draw(*shape) for name, shape in HEAD.tensors})
    return LoRAWeights("x", {(0, "q_proj"): LoRAModule(draw(MAX_RANK, IN), draw(OUT, MAX_RANK), 2.0)}, head, tower)


def test_head_and_tower_read_back_from_the_arena_and_the_host_copy():
    module = LoRALinear(IN, (OUT,), bias=False)
    arena = kernels.AdapterArena(4 * module.slot_elems([MAX_RANK]) + 1024, torch.float32, "cpu")
    module.init_slots(2, MAX_RANK, arena)
    memory = GpuAdapterMemory({(0, "q_proj"): (module, 0)}, arena, MAX_RANK)
    weights = _weights(torch.Generator().manual_seed(0))
    pages = HostPages(64 * 1024, page_locked=False, page_bytes=128)  # small pages: the copy spans many
    held = pages.take(3 * 128)
    pages.give_back(held[1:2])  # a hole between two held pages: the copy starts in it and goes on after them
    packed = memory.pack(weights, pages)
    assert len(list(pages.runs(packed.pages, packed.nbytes))) > 1
    memory.install(1, packed, stream=None)
    for read in (memory.tower(1), memory.host_tower(packed)):
        assert read.spec == TOWER and read.tensors.keys() == weights.tower.tensors.keys()
        for name, tensor in weights.tower.tensors.items():
            assert torch.equal(read.tensors[name], tensor), name
    head = memory.head(1)
    assert head.head == HEAD and all(torch.equal(head.tensors[n], t) for n, t in weights.head.tensors.items())
