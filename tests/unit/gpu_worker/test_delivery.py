"""How the engine thread hands outputs to callers' event loops: one wake-up per loop per step."""

from __future__ import annotations

import asyncio

from gpu_worker.delivery import RequestHandle, RequestOutput, deliver


def _output(text: str) -> RequestOutput:
    return RequestOutput(token_ids=[1], text=text)


def test_one_wake_up_per_event_loop_with_items_in_order():
    loops = [asyncio.new_event_loop(), asyncio.new_event_loop()]
    wake_ups = {id(loop): 0 for loop in loops}
    for loop in loops:
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args, _loop=loop, _schedule=schedule):
            wake_ups[id(_loop)] += 1
            return _schedule(callback, *args)
        loop.call_soon_threadsafe = counted
    handles = [RequestHandle(f"r{i}", loops[i % 2]) for i in range(4)]
    deliver([(handles[i % 4], _output(f"{i}")) for i in range(8)])  # two items for each handle
    assert wake_ups == {id(loops[0]): 1, id(loops[1]): 1}
    for i, handle in enumerate(handles):
        loop = loops[i % 2]
        loop.run_until_complete(asyncio.sleep(0))
        got = [handle._queue.get_nowait().text for _ in range(handle._queue.qsize())]
        assert got == [f"{i}", f"{i + 4}"]
    for loop in loops:
        loop.close()


def test_a_closed_loop_does_not_stop_delivery_to_the_others():
    closed, open_ = asyncio.new_event_loop(), asyncio.new_event_loop()
    closed.close()
    gone, listening = RequestHandle("gone", closed), RequestHandle("listening", open_)
    deliver([(gone, _output("lost")), (listening, _output("kept"))])
    open_.run_until_complete(asyncio.sleep(0))
    assert listening._queue.get_nowait().text == "kept"
    open_.close()
