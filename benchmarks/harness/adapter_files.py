"""Real PEFT LoRA adapters on disk for benchmarks: adapter_config.json (written by PEFT's LoraConfig)
and adapter_model.safetensors (tensor names as PEFT saves them for a Llama, random weights drawn on the
device), in an adapter store directory, each with the content digest the registry would record and
the worker's loader verifies. The worker reads, verifies and parses them as any registered adapter.

Every adapter is new to the worker (its own digest), but adapters of one shape share one weights file
through hard links: a 7B's rank-128 adapter on all seven projections is 640 MB, and a benchmark asks
for hundreds. Their configs differ in lora_alpha (rank + serial / 1024), which gives each its digest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from benchmarks.harness.shapes import ALL_SEVEN, QKVO
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.models.llama import LORA_TARGETS
from gpu_worker.profile import projection_dims
from services.common.adapter_layout import CONFIG_FILE, TEXT_LAYOUT, WEIGHTS_FILE, content_digest, file_sha256


@dataclass(frozen=True)
class AdapterShape:
    rank: int
    targets: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"r{self.rank}-" + ("qkvo" if self.targets == QKVO else "all7" if self.targets == ALL_SEVEN
                                   else "+".join(self.targets))


@dataclass(frozen=True)
class StoredAdapter:
    ref: AdapterRef
    shape: AdapterShape
    true_bytes: int  # its A and B tensors in the served dtype: what it must occupy at least

    @property
    def files(self) -> tuple[Path, Path]:
        directory = Path(self.ref.storage_path)
        return directory / CONFIG_FILE, directory / WEIGHTS_FILE


def adapter_bytes(config: PretrainedConfig, shape: AdapterShape, itemsize: int) -> int:
    """Bytes of an adapter's A [r, in] and B [out, r] over every layer and target."""
    dims = projection_dims(config)
    return shape.rank * sum(sum(dims[t]) for t in shape.targets) * config.num_hidden_layers * itemsize


class AdapterStore:
    """Writes adapters for `config` under `root` (the worker's adapter_store)."""

    def __init__(self, root: Path, config: PretrainedConfig, base_model: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.root = root
        self._config = config
        self._base_model = base_model
        self._dtype = dtype
        self._device = device
        self._weights: dict[AdapterShape, tuple[Path, str]] = {}  # shape -> (weights file, its sha256)
        self._serial = 0

    def new(self, shape: AdapterShape) -> StoredAdapter:
        """An adapter no worker has seen: a fresh directory and digest."""
        from peft import LoraConfig  # 4 s to import; only the benchmark's writer needs it

        self._serial += 1
        name = f"{shape.label}-{self._serial}"
        directory = self.root / name
        weights, weights_sha = self._weights.get(shape) or self._write_weights(shape)
        LoraConfig(r=shape.rank, lora_alpha=shape.rank + self._serial / 1024, target_modules=list(shape.targets),
                   lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                   base_model_name_or_path=self._base_model).save_pretrained(str(directory))
        os.link(weights, directory / WEIGHTS_FILE)
        digest = content_digest(file_sha256(directory / CONFIG_FILE), weights_sha)
        ref = AdapterRef(name, self._base_model, shape.rank, digest, str(directory))
        itemsize = torch.empty((), dtype=self._dtype).element_size()
        return StoredAdapter(ref, shape, adapter_bytes(self._config, shape, itemsize))

    def _write_weights(self, shape: AdapterShape) -> tuple[Path, str]:
        dims = projection_dims(self._config)
        gen = torch.Generator(device=self._device).manual_seed(shape.rank * 100 + len(shape.targets))

        def draw(rows: int, cols: int) -> torch.Tensor:
            # Drawn on the device: a rank-128 adapter of a 7B is 3 x 10^8 numbers, minutes on a CPU.
            return (torch.randn(rows, cols, generator=gen, device=self._device) * 0.01).to(self._dtype).cpu()

        tensors = {}
        for layer in range(self._config.num_hidden_layers):
            for target in shape.targets:
                in_features, out_features = dims[target]
                tensors[TEXT_LAYOUT.tensor_name(layer, LORA_TARGETS[target], "A")] = draw(shape.rank, in_features)
                tensors[TEXT_LAYOUT.tensor_name(layer, LORA_TARGETS[target], "B")] = draw(out_features, shape.rank)
        path = self.root / "_weights" / f"{shape.label}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"format": "pt"})  # as PEFT's save_pretrained writes it
        self._weights[shape] = path, file_sha256(path)
        return self._weights[shape]


def drop_from_page_cache(paths: tuple[Path, ...]) -> None:
    """Ask the kernel to forget the files' cached pages, so the next read comes from the device
    (best effort: a no-op on tmpfs)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs", ...), from /proc/mounts."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and (resolved + "/").startswith(fields[1].rstrip("/") + "/") and len(fields[1]) >= len(best):
            best, kind = fields[1], fields[2]
    return kind
