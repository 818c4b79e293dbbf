"""Outputs on their way from the engine thread to the callers' event loops.

Each live request has a RequestHandle, an async iterator on its caller's event loop. The engine
thread hands items to the handles with `deliver`: one `loop.call_soon_threadsafe` per event loop and
call, however many handles and items it carries. `Streams` is the engine thread's side: the live
requests and their handles, and the tokens sampled but not streamed yet, which `flush` detokenizes
and delivers (the engine calls it while the device runs the next step).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gpu_worker.heads import HeadAnswer
from gpu_worker.sampler import TokenLogprobs
from gpu_worker.sequence import FinishReason, Sequence
from services.common.errors import TesseraError


@dataclass(frozen=True)
class RequestOutput:
    """One streamed increment; the last one has `finish_reason` set and the whole text."""
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    full_text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked for them
    head: HeadAnswer | None = None            # a task-head request's answer (its only, last output)


class RequestHandle:
    """Async iterator over a request's outputs; raises the engine's error if the request failed."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | TesseraError] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, TesseraError):
                self.finished = True
                raise item
            self.finished = item.finish_reason is not None
            yield item


def deliver(items: list[tuple[RequestHandle, RequestOutput | TesseraError]]) -> None:
    """Put each item into its handle's queue, from the engine thread: one wake-up of each event
    loop for all of its handles' items, in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | TesseraError]]] = {}
    for handle, item in items:
        by_loop.setdefault(handle._loop, []).append((handle._queue, item))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


def _put_all(puts: list[tuple[asyncio.Queue, RequestOutput | TesseraError]]) -> None:
    for queue_, item in puts:
        queue_.put_nowait(item)


def aborted_output(seq: Sequence) -> RequestOutput:
    """The last output of a request aborted before it finished: the text held back so far."""
    return RequestOutput([], seq.detokenizer.take_delta(True), FinishReason.ABORT, seq.prompt_len,
                         len(seq.output_token_ids), seq.detokenizer.text)


class Streams:
    """The live requests' output streams, touched by the engine thread only. `on_close(request_id)`
    runs as a request is forgotten, before its last item is delivered (the id may then be reused)."""

    def __init__(self, on_close: Callable[[str], None]) -> None:
        self._on_close = on_close
        self._live: dict[str, tuple[Sequence, RequestHandle]] = {}  # request id -> its sequence and handle
        # Sampled tokens whose outputs are not sent yet: (sequence, token, log-probabilities).
        self._unsent: list[tuple[Sequence, int, TokenLogprobs | None]] = []
        self._answers: list[tuple[Sequence, HeadAnswer]] = []  # head answers not sent yet

    def open(self, seq: Sequence, handle: RequestHandle) -> None:
        self._live[seq.request_id] = seq, handle

    def find(self, request_id: str) -> Sequence | None:
        live = self._live.get(request_id)
        return live[0] if live is not None else None

    def sequences(self) -> list[Sequence]:
        return [seq for seq, _ in self._live.values()]

    def push(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """A sampled token of `seq`, to stream at the next `flush`."""
        self._unsent.append((seq, token, logprobs))

    def answer(self, seq: Sequence, answer: HeadAnswer) -> None:
        """A task-head request's answer, to send (and close it) at the next `flush`."""
        self._answers.append((seq, answer))

    def flush(self) -> bool:
        """Detokenize the unsent tokens and stream them, send the head answers; close the requests they
        finished. -> whether there were any."""
        unsent, self._unsent = self._unsent, []
        answers, self._answers = self._answers, []
        items: list[tuple[RequestHandle, RequestOutput | TesseraError]] = [
            (self.close(seq), RequestOutput([], "", seq.finish_reason, seq.prompt_len, 0, head=answer))
            for seq, answer in answers]
        for seq, token, logprobs in unsent:
            seq.decode_text()
            final = seq.finish_reason is not None
            text, token_logprobs = seq.detokenizer.take_delta(final), (logprobs,) if logprobs is not None else ()
            if final:
                items.append((self.close(seq), RequestOutput(
                    [token], text, seq.finish_reason, seq.prompt_len, len(seq.output_token_ids), seq.detokenizer.text,
                    token_logprobs)))
            else:
                items.append((self._live[seq.request_id][1], RequestOutput([token], text, logprobs=token_logprobs)))
        deliver(items)
        return bool(items)

    def close(self, seq: Sequence) -> RequestHandle:
        """Forget a request whose scheduler resources are freed; -> its handle, for the last item."""
        _, handle = self._live.pop(seq.request_id)
        self._on_close(seq.request_id)
        return handle
