"""The arithmetic of a LoRA work-area job (shm.py): the LoRA delta of a share of its tokens, in float32.
The CPU LoRA workers run it; the GPU worker runs it itself when a worker fails a job."""

from __future__ import annotations

import numpy as np
import torch

from services.common.cpu_lora.shm import Job


def block(region: torch.Tensor, pages: np.ndarray, page_elems: int, table: int, offset: int, count: int
          ) -> torch.Tensor:
    """Elements [offset, offset + count) of an adapter's packed copy, whose pages are listed in
    `pages` from entry `table` on: a view when they lie in one page, else gathered."""
    pieces = []
    while count:
        page, within = divmod(offset, page_elems)
        take = min(count, page_elems - within)
        start = int(pages[table + page]) * page_elems + within
        pieces.append(region[start:start + take])
        offset, count = offset + take, count - take
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def lora_delta(job: Job, y: np.ndarray, region: torch.Tensor) -> None:
    """y[t, out:out+size] = scaling * x[t] @ A.T @ Bt for each segment's tokens inside the job's share;
    `region` is the flat weights region (any float dtype) the job's page table points into."""
    first, last = job.share
    in_features = job.x.shape[1]
    for s in job.segments:
        begin, end = max(s.first, first), min(s.last, last)
        if begin >= end:
            continue
        a = block(region, job.pages, job.page_elems, s.table, s.a_offset, s.rank * in_features)
        bt = block(region, job.pages, job.page_elems, s.table, s.bt_offset, s.rank * s.out_size)
        delta = (torch.from_numpy(job.x[begin:end]) @ a.view(s.rank, in_features).float().t()) \
            @ bt.view(s.rank, s.out_size).float()
        torch.from_numpy(y[begin:end, s.out_offset:s.out_offset + s.out_size]).copy_(delta.mul_(s.scaling))
