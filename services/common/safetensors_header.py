"""Read and check a safetensors file's header without torch and without loading tensors (the registry
checks uploads with it; the worker's loader lays tensors over the verified bytes by it).

Layout: 8-byte little-endian header length N, N bytes of JSON
``{"name": {"dtype": "F32", "shape": [r, in], "data_offsets": [begin, end]}, ...}``,
then the data section. Offsets are relative to the data section, tensors are
contiguous, and the file ends exactly at the last tensor's end: any shorter
file is truncated, any gap or overlap is corruption.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument
from services.common.strict_json import loads as strict_json_loads

MAX_HEADER_BYTES = 100 * 1024 * 1024
# LoRA weights are floating point; anything else is not an adapter we can serve.
DTYPE_BYTES: dict[str, int] = {"F16": 2, "BF16": 2, "F32": 4}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor_info(label: str, name: str, entry: Any) -> TensorInfo:
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{label}: header entry for tensor {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise InvalidArgument(
            f"{label}: tensor {name!r} has unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise InvalidArgument(f"{label}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise InvalidArgument(f"{label}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise InvalidArgument(
            f"{label}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs {expected}")
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_layout(label: str, tensors: dict[str, TensorInfo], data_bytes: int) -> None:
    """Tensors must tile the data section exactly: [0, e1), [e1, e2), ... up to the file's end."""
    needed = max((t.end for t in tensors.values()), default=0)
    if needed > data_bytes:
        raise InvalidArgument(
            f"{label}: file is truncated: tensors need {needed} data bytes, the file holds {data_bytes}")
    position = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != position:
            raise InvalidArgument(f"{label}: tensor {name!r} overlaps another or leaves a gap (corrupt header)")
        position = info.end
    if position != data_bytes:
        raise InvalidArgument(
            f"{label}: {data_bytes - position} unexpected trailing bytes after the last tensor (corrupt file)")


def header_length(prefix: bytes, file_size: int, label: str) -> int:
    """The JSON header's length from the file's first 8 bytes; InvalidArgument if it cannot fit."""
    if len(prefix) != 8:
        raise InvalidArgument(f"{label}: {file_size} bytes is too short for a safetensors file")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES:
        raise InvalidArgument(
            f"{label}: header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt header)")
    if 8 + length > file_size:
        raise InvalidArgument(f"{label}: file is truncated: header needs {length} bytes")
    return length


def parse_header(raw: bytes, data_bytes: int, label: str) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo from the JSON header `raw`, checked against a data section of `data_bytes`."""
    try:
        header = strict_json_loads(raw, f"{label}: header")
    except InvalidArgument as exc:
        raise InvalidArgument(f"{exc.message} (corrupt header)") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{label}: header is not a JSON object (corrupt header)")
    header.pop("__metadata__", None)
    tensors = {name: _tensor_info(label, name, entry) for name, entry in header.items()}
    _check_layout(label, tensors, data_bytes)
    return tensors


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for the file at `path`; InvalidArgument if it is not a sound safetensors file."""
    label = path.name
    with path.open("rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        length = header_length(f.read(8), file_size, label)
        raw = f.read(length)
    return parse_header(raw, file_size - 8 - length, label)
