"""Compile Triton kernels before serving, on a pool of threads, without launching them.

A Triton kernel compiles on its first call with a new set of compile-time values and stalls that
call's whole step (a fraction of a second to seconds each on a fresh machine, and a first request
met several: docs/benchmarks/engine.md).
The worker therefore requests every variant it can meet before it serves: each kernel module lists
its own (`warm_up_*`) through its compile-only launch path, and this context runs those compiles
in parallel.

A compiled kernel is not yet ready to launch: its first launch loads it onto the GPU and builds its
host-side launcher, a small C module that Triton compiles with the system's C compiler unless its
disk cache holds one. On a fresh cache that stalled a worker's first merge and first unmerge:
those kernels are compiled ahead but, unlike the others, never launched before serving. So the
context also loads every kernel it compiled, still without launching it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction
from triton.runtime._async_compile import AsyncCompileMode


# The kernels that compile-only launches inside `compiling_ahead` returned: compiled, or compiling.
_compiled_ahead: ContextVar[list[object] | None] = ContextVar("compiled_ahead", default=None)


def launcher(kernel: JITFunction, grid: tuple[int, ...], compile_only: bool) -> Callable[..., object]:
    """`kernel[grid]`, or with compile_only the same call compiling without launching: every
    kernel's one launch path serves both, so the warm-up compiles exactly what serving runs."""
    if not compile_only:
        return kernel[grid]

    def compile_without_launch(*args: object, **kwargs: object) -> object:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        pending = _compiled_ahead.get()
        if pending is not None and compiled is not None:
            pending.append(compiled)
        return compiled
    return compile_without_launch


@contextmanager
def compiling_ahead(jobs: int | None = None) -> Iterator[None]:
    """Compile-only launches made inside compile on `jobs` threads; when the block exits every
    compile has finished (or raised) and every kernel compiled is loaded on the current GPU, its
    launcher built."""
    compiled: list[object] = []
    with ThreadPoolExecutor(jobs or min(16, os.cpu_count() or 1)) as pool:
        token = _compiled_ahead.set(compiled)
        try:
            with AsyncCompileMode(pool):
                yield
        finally:
            _compiled_ahead.reset(token)
        device = torch.cuda.current_device()
        unique = {id(kernel): kernel for kernel in compiled}.values()  # a variant asked twice compiles once
        list(pool.map(lambda kernel: _load(kernel, device), unique))


def _load(kernel: object, device: int) -> None:
    """Load a compiled kernel onto `device` and build its launcher, launching nothing."""
    torch.cuda.set_device(device)  # a pool thread's current device is device 0
    compiled: CompiledKernel = kernel.result() if hasattr(kernel, "result") else kernel  # async: a future
    compiled.run  # noqa: B018 -- the property loads the module and builds the launcher on first access


@contextmanager
def compiles_recorded() -> Iterator[list[str]]:
    """Inside: each kernel variant this process compiles (or loads from Triton's disk cache) for
    the first time, as Triton describes it (kernel, constexprs, specialized arguments), and each
    kernel loaded onto the GPU for the first time ("loaded <name>"), appended to the yielded list.
    Tests assert it stays empty once a worker is warmed up."""
    compiled: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def loaded(module: object, function: object, name: str, *args: object) -> None:
        compiled.append(f"loaded {name}")
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs["repr"])
    knobs.runtime.kernel_load_start_hook.add(loaded)
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous
        knobs.runtime.kernel_load_start_hook.remove(loaded)
