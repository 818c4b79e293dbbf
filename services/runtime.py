"""Process entry helpers: the event loop (uvloop) and graceful shutdown on signals."""

from __future__ import annotations

import asyncio
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
