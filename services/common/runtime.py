"""Process entry helpers: the event loop (uvloop), graceful shutdown on signals, and a garbage
collector that leaves the startup heap alone."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop_event)` on uvloop; SIGINT/SIGTERM set the event.

    `main` starts its servers, awaits the event, then shuts down cleanly.
    """
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop does not exist on Windows
        runner = asyncio.run

    async def _entry() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    runner(_entry())


def freeze_startup_heap() -> None:
    """Collect, then move every object alive into the collector's permanent generation.

    A serving process builds hundreds of thousands of long-lived objects at startup (the model,
    Triton's compiled kernels, CUDA graphs) and every full collection would walk them all while
    holding the GIL, a stall of every request in flight that grows with the model (the measured
    stalls are in docs/benchmarks/engine.md).
    Frozen, they are never walked again; objects made later are collected as before.
    """
    gc.collect()
    gc.freeze()
