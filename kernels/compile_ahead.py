"""Compile Triton kernels before serving, on a pool of threads, without launching them.

A Triton kernel compiles on its first call with a new set of compile-time values and stalls that
call's whole step (~0.3-2 s each on a fresh machine; the first request of a new H100 waited ~5 s).
The worker therefore requests every variant it can meet before it serves: each kernel module lists
its own (`warm_up_*`) through its compile-only launch path, and this context runs those compiles
in parallel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from triton import knobs
from triton.runtime import JITFunction
from triton.runtime._async_compile import AsyncCompileMode


def launcher(kernel: JITFunction, grid: tuple[int, ...], compile_only: bool) -> Callable[..., object]:
    """`kernel[grid]`, or with compile_only the same call compiling without launching: every
    kernel's one launch path serves both, so the warm-up compiles exactly what serving runs."""
    return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]


@contextmanager
def compiling_ahead(jobs: int | None = None) -> Iterator[None]:
    """Compile-only launches made inside compile on `jobs` threads; every compile has finished (or
    raised) when the block exits."""
    with ThreadPoolExecutor(jobs or min(16, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
        yield


@contextmanager
def compiles_recorded() -> Iterator[list[str]]:
    """Inside: each kernel variant this process compiles (or loads from Triton's disk cache) for
    the first time, as Triton describes it (kernel, constexprs, specialized arguments), appended to
    the yielded list. Tests assert it stays empty once a worker is warmed up."""
    compiled: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs["repr"])
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous
