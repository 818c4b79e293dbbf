"""Turns the last-position logits of each sequence into its next token, on the logits' device.

Greedy rows take the argmax. Sampled rows are filtered together (temperature, then top-k, then
top-p, each row with its own values) over one descending sort, and drawn by the exponential race
(argmax of p / E with E ~ Exp(1)) with noise from the sequence's own torch.Generator, so a seeded
request gives the same tokens however it is batched. The tokens stay on the device, where the next
step can take them as its input ids before the host has them (the engine's async scheduling); one
asynchronous copy per step brings them (and, where asked, log-probabilities) to the host.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from gpu_worker.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                          # of the chosen token, under the model's distribution
    top: tuple[tuple[int, float], ...]      # the `logprobs` most likely tokens, best first


def _is_greedy(seq: Sequence) -> bool:
    return seq.params.temperature == 0 or seq.params.top_k == 1


class SampledTokens:
    """One step's sampled tokens: on the device at once, on the host at `result()`."""

    def __init__(self, seqs: Seq[Sequence], tokens: torch.Tensor, logprobs: _LogprobTensors | None) -> None:
        self.seqs = list(seqs)      # the sequences that sampled, in row order
        self.tokens = tokens        # [len(seqs)] int64 on the logits' device
        self._host = [_to_host(t) for t in (tokens, *(logprobs.tensors if logprobs else ()))]
        self._wanted = logprobs.rows if logprobs else []
        self._ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """(one token id per sequence, its log-probabilities if asked); waits for the device."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, *rest = (t.tolist() for t in self._host)
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if rest:
            chosen, top_values, top_ids = rest
            for i, row in enumerate(self._wanted):
                count = self.seqs[row].params.logprobs
                logprobs[row] = TokenLogprobs(chosen[i], tuple(zip(top_ids[i][:count], top_values[i][:count])))
        return tokens, logprobs


@dataclass(frozen=True)
class _LogprobTensors:
    rows: list[int]        # the rows that asked for log-probabilities
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # chosen [w], top values [w, k], top ids [w, k]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into pinned host memory (CUDA); the tensor itself elsewhere."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def sample(logits: torch.Tensor, seqs: Seq[Sequence]) -> SampledTokens:
    """logits: float32 [num_seqs, vocab] -> one token id per sequence (and its log-probabilities if asked)."""
    assert logits.shape[0] == len(seqs)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, seq in enumerate(seqs) if not _is_greedy(seq)]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [seqs[row] for row in sampled_rows])
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    logprobs = _logprobs(logits, tokens, wanted, [seqs[r].params.logprobs for r in wanted]) if wanted else None
    return SampledTokens(seqs, tokens, logprobs)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [n, vocab] of sampled rows -> token ids [n]."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([s.params.temperature for s in seqs], device=device)
    top_k = torch.tensor([s.params.top_k or vocab for s in seqs], device=device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token if the mass before it is below top_p (so the top token always stays).
    probs = probs.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], 0.0)
    noise = torch.stack([torch.empty(vocab, device=device).exponential_(generator=_generator(s, device))
                         for s in seqs])
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return order.gather(1, choice).squeeze(1)


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    """The sequence's own random stream, created at its first sampled token."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        if seq.params.seed is None:
            seq.generator.seed()
        else:
            seq.generator.manual_seed(seq.params.seed)
    return seq.generator


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], counts: list[int]) -> _LogprobTensors:
    """Log-probabilities of the chosen tokens and the top max(`counts`) alternatives of `rows`."""
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits[index], dim=-1)
    chosen = logp.gather(1, tokens[index][:, None]).squeeze(1)
    top_values, top_ids = logp.topk(max(max(counts), 1), dim=-1)
    return _LogprobTensors(rows, (chosen, top_values, top_ids))
