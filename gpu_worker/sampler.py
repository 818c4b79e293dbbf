"""Turns the last-position logits of each sequence into its next token.

Greedy rows take the argmax; sampled rows apply temperature, top-k, then top-p, and draw with the
sequence's own torch.Generator, so a seeded request gives the same tokens however it is batched.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from gpu_worker.sequence import Sequence


def sample(logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """logits: float32 [num_seqs, vocab] -> one token id per sequence."""
    assert logits.shape[0] == len(seqs)
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.temperature == 0 or p.top_k == 1:
            tokens.append(greedy[row])
            continue
        probs = _filtered_probs(logits[row] / p.temperature, p.top_k, p.top_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=_generator(seq, logits.device)).item()))
    return tokens


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    """The sequence's own random stream, created at its first sampled token."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        if seq.params.seed is None:
            seq.generator.seed()
        else:
            seq.generator.manual_seed(seq.params.seed)
    return seq.generator


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] -> probabilities with everything outside top-k / the top-p nucleus at 0."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[0])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token if the mass before it is below top_p (so the top token always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
