"""The shared-memory work area between a GPU worker and its CPU LoRA workers (CaraServe's CPU-assisted
prefill): per LoRA layer the worker writes the cold requests' input rows and a list of segments, and
bumps each CPU worker's request counter; each CPU worker computes the LoRA delta of its share of the
tokens, writes it to the output rows and sets its done counter. No pickling and no sockets per layer:
only loads and stores on one mapped file (on x86, stores are seen in order, so a counter written after
the data it publishes is never seen before that data).

Layout of the file (int64 / float32, little-endian), for `workers` CPU workers:

    header     [MAGIC, workers, max_tokens, max_in, max_out, max_segments, max_pages]  8 x int64
    control    per worker, one cache line each: [request, done, status, pid, first token, last token,
               rate at ranks 8, 16, 32, 64, 128 (tokens/s on one core), and where a sidecar runs
               the workers: its last sign of the worker's life (unix ms), kills asked, kills done]
                                                                                      16 x int64
    job        [num_tokens, in_features, out_features, num_segments, page elements]   8 x int64
    segments   per segment: [first token, last token, A offset, Bt offset, rank, out offset, out size,
               scaling as float64 bits, first page-table entry]                        9 x int64
    pages      the job's page table: page numbers in the weights region                max_pages x int64
    x          [max_tokens, max_in] float32: the input rows
    y          [max_tokens, max_out] float32: the LoRA deltas (the worker adds them to its projection)

A segment is one adapter slice over a run of tokens: y[t, out:out+size] = scaling * x[t] @ A.T @ Bt
for t in [first, last) (the rest of y is not written: readers take the segments' parts), where
A [rank, in] and Bt [rank, size] lie in the adapter's packed copy (the adapter arena's layout,
kernels/lora_stack.py) at those element offsets; the copy is spread over pages of the weights region
(the worker's host tier), listed from the segment's page-table entry on.
The file is created by the GPU worker, private to its user (0600); the CPU workers map it read-write,
the weights read-only. Where a sidecar container runs the CPU workers, the GPU worker names both files
in a manifest in the shared directory, and the last three control words are their handshake (sidecar.py).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = 0x54455353_4C4F5241  # "TESSLORA"
HEADER = 8
CONTROL = 16  # int64 per worker: one 128-byte line, so that no two workers write the same cache line
JOB = 8
SEGMENT = 9
RATE_RANKS = (8, 16, 32, 64, 128)
REQUEST, DONE, STATUS, PID, FIRST, LAST, RATES = range(7)
BEAT, KILL, KILLED = range(RATES + len(RATE_RANKS), RATES + len(RATE_RANKS) + 3)
STATUS_OK, STATUS_FAILED = 0, 1


@dataclass(frozen=True)
class Segment:
    first: int        # tokens [first, last) of the job
    last: int
    a_offset: int     # element offsets of A [rank, in] and Bt [rank, size] in the weights region
    bt_offset: int
    rank: int
    out_offset: int   # the output columns [out_offset, out_offset + out_size) of y
    out_size: int
    scaling: float
    table: int = 0    # where the adapter's pages start in the job's page table


@dataclass(frozen=True)
class Job:
    x: np.ndarray              # [tokens, in] the input rows
    out_features: int
    segments: list[Segment]
    share: tuple[int, int]     # this worker's tokens [first, last)
    pages: np.ndarray          # the page table (entries from each segment's `table` on)
    page_elems: int            # elements of the weights region per page


def create_mapping(path: Path, nbytes: int) -> mmap.mmap:
    """A new zeroed file of `nbytes` at `path` (private to this user; fails if the path exists), mapped
    shared. Its bytes are taken now: a file in a full tmpfs (a container's 64 MB /dev/shm) would
    otherwise take them page by page as they are written, and the first page short kills the process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise OSError(exc.errno, f"cannot hold {nbytes} bytes in {path.parent} ({exc.strerror}): give it "
                                     "more room (docker --shm-size) or set worker.cpu_lora_shm_dir elsewhere") from None
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def even_shares(tokens: int, workers: int) -> list[tuple[int, int]]:
    """[first, last) of each worker's share of `tokens`, as even as whole tokens allow."""
    bounds = [tokens * w // workers for w in range(workers + 1)]
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class Shape:
    workers: int
    max_tokens: int
    max_in: int
    max_out: int
    max_segments: int
    max_pages: int

    @property
    def int_words(self) -> int:
        return HEADER + CONTROL * self.workers + JOB + SEGMENT * self.max_segments + self.max_pages

    @property
    def nbytes(self) -> int:
        return 8 * self.int_words + 4 * self.max_tokens * (self.max_in + self.max_out)


class WorkArea:
    """One mapping of the work area: the GPU worker's (`create`) or a CPU worker's (`open`)."""

    def __init__(self, path: Path, shape: Shape, mapping: mmap.mmap) -> None:
        self.path, self.shape, self._mapping = path, shape, mapping
        self._posted: list[int] = []  # the workers asked for the job posted last (the GPU worker's side)
        words = np.frombuffer(mapping, dtype=np.int64, count=shape.int_words)
        self.control = words[HEADER:HEADER + CONTROL * shape.workers].reshape(shape.workers, CONTROL)
        self.job = words[HEADER + CONTROL * shape.workers:][:JOB]
        at = HEADER + CONTROL * shape.workers + JOB
        self.segments = words[at:at + SEGMENT * shape.max_segments].reshape(shape.max_segments, SEGMENT)
        self.pages = words[at + SEGMENT * shape.max_segments:]
        floats = np.frombuffer(mapping, dtype=np.float32, offset=8 * shape.int_words)
        self.x = floats[:shape.max_tokens * shape.max_in].reshape(shape.max_tokens, shape.max_in)
        self.y = floats[shape.max_tokens * shape.max_in:].reshape(shape.max_tokens, shape.max_out)

    @classmethod
    def create(cls, path: Path, shape: Shape) -> WorkArea:
        """A new zeroed work area at `path` (private to this user); fails if the path exists."""
        mapping = create_mapping(path, shape.nbytes)
        header = np.frombuffer(mapping, dtype=np.int64, count=HEADER)
        header[:7] = (MAGIC, shape.workers, shape.max_tokens, shape.max_in, shape.max_out, shape.max_segments,
                      shape.max_pages)
        return cls(path, shape, mapping)

    @classmethod
    def open(cls, path: Path) -> WorkArea:
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        magic, *sizes = np.frombuffer(mapping, dtype=np.int64, count=7).tolist()
        if magic != MAGIC:
            raise ValueError(f"{path} is not a Tessera LoRA work area")
        shape = Shape(*sizes)
        if mapping.size() != shape.nbytes:
            raise ValueError(f"{path}: {mapping.size()} bytes, its header says {shape.nbytes}")
        return cls(path, shape, mapping)

    # --- the GPU worker's side ---

    def post(self, x: np.ndarray | torch.Tensor, out_features: int, segments: list[Segment],
             shares: list[tuple[int, int]], pages: list[int], page_elems: int) -> None:
        """Publish a job: input rows `x` [tokens, in] (any float dtype, on the host), `segments`, each
        worker's token share [first, last) (a worker with an empty share is not asked), and the page table
        `pages` of the weights region's pages of `page_elems` elements that the segments' adapters lie in.
        The answer fills each segment's rows and columns of y; other parts of y are left as they were."""
        tokens, in_features = x.shape
        shape = self.shape
        if tokens > shape.max_tokens or in_features > shape.max_in or out_features > shape.max_out:
            raise ValueError(f"job of {tokens} x {in_features} -> {out_features} exceeds the work area {shape}")
        if len(segments) > shape.max_segments or len(shares) != shape.workers or len(pages) > shape.max_pages:
            raise ValueError(f"{len(segments)} segments, {len(shares)} shares, {len(pages)} pages for {shape}")
        torch.from_numpy(self.x[:tokens, :in_features]).copy_(torch.as_tensor(x))  # converted on the way
        for row, s in zip(self.segments, segments):
            row[:7] = (s.first, s.last, s.a_offset, s.bt_offset, s.rank, s.out_offset, s.out_size)
            row[7] = struct.unpack("<q", struct.pack("<d", s.scaling))[0]
            row[8] = s.table
        self.pages[:len(pages)] = pages
        self.job[:5] = (tokens, in_features, out_features, len(segments), page_elems)
        self._posted = [worker for worker, (first, last) in enumerate(shares) if last > first]
        for worker in self._posted:
            control = self.control[worker]
            control[FIRST], control[LAST] = shares[worker]
            control[REQUEST] += 1  # last: publishes everything above

    def wait(self, timeout_s: float, alive: Callable[[int], bool] = lambda worker: True) -> None:
        """Until every worker has answered the posted job. TimeoutError names the workers that did not
        (`alive` says no, or stuck past `timeout_s`); RuntimeError those that failed it."""
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        while pending := self.pending():
            if time.monotonic() > deadline or not all(alive(w) for w in pending):
                pids = [int(self.control[w, PID]) for w in pending]
                raise TimeoutError(f"CPU LoRA workers {pending} (pids {pids}) gave no answer (dead, or stuck "
                                   f"past {timeout_s:g} s)")
            if pause:
                time.sleep(pause)
            pause = min(1e-3, pause * 2 or 1e-5)  # a layer's share takes 0.1-10 ms: poll, then back off
        if failed := self.failed():
            raise RuntimeError(f"CPU LoRA workers {failed} failed the job (see their logs)")

    def pending(self) -> list[int]:
        """Workers asked for the posted job whose answer has not come."""
        return [w for w in self._posted if self.control[w, DONE] != self.control[w, REQUEST]]

    def failed(self) -> list[int]:
        """Workers asked for the posted job that answered it with a failure."""
        return [w for w in self._posted if self.control[w, DONE] == self.control[w, REQUEST]
                and self.control[w, STATUS] != STATUS_OK]

    # --- a CPU worker's side ---

    def read_job(self, worker: int) -> Job:
        """The posted job, with this worker's share of its tokens."""
        tokens, in_features, out_features, count, page_elems = self.job[:5].tolist()
        segments = [Segment(*row[:7].tolist(), struct.unpack("<d", struct.pack("<q", int(row[7])))[0], int(row[8]))
                    for row in self.segments[:count]]
        control = self.control[worker]
        return Job(self.x[:tokens, :in_features], out_features, segments, (int(control[FIRST]), int(control[LAST])),
                   self.pages, page_elems)

    def close(self) -> None:
        self.control = self.job = self.segments = self.pages = self.x = self.y = None  # views pin the mapping
        try:
            self._mapping.close()
        except BufferError:  # a caller still holds a view: the mapping goes with the last one
            pass
