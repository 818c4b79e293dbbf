"""A CPU LoRA worker's arithmetic: the LoRA delta of its share of a job's tokens, in float32."""

from __future__ import annotations

import numpy as np
import torch

from services.common.lora_shm import Segment


def lora_delta(x: np.ndarray, y: np.ndarray, weights: torch.Tensor, segments: list[Segment],
               share: tuple[int, int]) -> None:
    """y[t, out:out+size] = scaling * x[t] @ A.T @ Bt for each segment's tokens inside `share`
    [first, last); `weights` is the flat adapter region (any float dtype), A [rank, in] and
    Bt [rank, size] at the segments' element offsets."""
    first, last = share
    in_features = x.shape[1]
    for s in segments:
        begin, end = max(s.first, first), min(s.last, last)
        if begin >= end:
            continue
        a = weights[s.a_offset:s.a_offset + s.rank * in_features].view(s.rank, in_features).float()
        bt = weights[s.bt_offset:s.bt_offset + s.rank * s.out_size].view(s.rank, s.out_size).float()
        rows = torch.from_numpy(x[begin:end])
        delta = (rows @ a.t()) @ bt
        torch.from_numpy(y[begin:end, s.out_offset:s.out_offset + s.out_size]).copy_(delta.mul_(s.scaling))
