"""One step's model inputs, built on the host from the scheduled sequences.

Sequences are ordered by adapter slot so that tokens sharing an adapter form one LoRA segment
(a batch of 32 decodes on one adapter is one segment, not 32). Everything is a plain list here;
the model runner makes device tensors of them with one copy each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import Sequence


@dataclass(frozen=True)
class ImageRows:
    """Packed rows [row, row + count) are image tokens of `seq`: they take its features
    [feature, feature + count) in place of their token embeddings."""
    seq: Sequence
    row: int
    feature: int
    count: int


@dataclass(frozen=True)
class HeadRows:
    """Packed rows of a task-head request among its prompt's last `head.positions` tokens; `completes`: the
    step runs the prompt's last token, so the head answers after it."""
    seq: Sequence
    rows: list[int]
    completes: bool


@dataclass(frozen=True)
class StepInputs:
    items: list[ScheduledSeq]        # batch order
    input_ids: list[int]             # [num_tokens]
    positions: list[int] | list[list[int]]  # [num_tokens], or [3][num_tokens] (M-RoPE) with a chunk over images
    slot_mapping: list[int]          # [num_tokens] KV-cache slot (block * block_size + offset) of each token
    query_lens: list[int]            # [num_seqs] new tokens of each sequence
    seq_lens: list[int]              # [num_seqs] cached + new tokens of each sequence
    block_tables: list[list[int]]    # [num_seqs][its blocks]
    seg_lens: list[int]              # LoRA segments: runs of consecutive tokens on one slot
    seg_slots: list[int]
    logit_rows: list[int]            # the last token of each sequence that samples
    sampling: list[Sequence]         # those sequences, in logit_rows order
    image_rows: list[ImageRows]      # the step's image tokens (prefill chunks of prompts with images)
    head_rows: list[HeadRows]        # the step's rows that task heads read

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank among the batch's sequences (0: none uses one)."""
        return max((item.seq.rank for item in self.items), default=0)

    @property
    def mean_lora_rank(self) -> float | None:
        """The adapter rank averaged over the step's adapter tokens (None: no token uses one)."""
        lora = [(item.num_new, item.seq.rank) for item in self.items if item.seq.rank > 0]
        tokens = sum(n for n, _ in lora)
        return sum(n * rank for n, rank in lora) / tokens if tokens else None

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens) and len(self.sampling) == len(self.items) \
            and not self.image_rows and not self.head_rows


@dataclass(frozen=True)
class InFlightIds:
    """A step's input ids that are still on the device (async scheduling): packed row `rows[i]` takes
    `tokens[sources[i]]`, the token its sequence sampled in the step before."""
    tokens: torch.Tensor   # that step's sampled tokens [its sampling sequences], int64 on the device
    rows: list[int]
    sources: list[int]

    @classmethod
    def of(cls, inputs: StepInputs, sampled: list[Sequence], tokens: torch.Tensor) -> InFlightIds | None:
        """The rows of `inputs` whose token is in flight, `sampled` being the sequences behind `tokens`;
        None when there are none. A sequence with a token in flight runs just that token (a decode)."""
        source_of = {id(seq): source for source, seq in enumerate(sampled)}
        rows, sources, row = [], [], 0
        for item in inputs.items:
            if item.seq.num_in_flight:
                assert item.num_new == 1 and id(item.seq) in source_of, (item.num_new, item.seq.request_id)
                rows.append(row)
                sources.append(source_of[id(item.seq)])
            row += item.num_new
        return cls(tokens, rows, sources) if rows else None

    def write_into(self, input_ids: torch.Tensor) -> None:
        """Overwrite the in-flight rows of the step's device ids [num_tokens] (stream-ordered after
        the step before, which produced them)."""
        count = len(self.rows)
        if self.rows == self.sources == list(range(count)):  # a decode of the same sequences: no gather
            input_ids[:count].copy_(self.tokens[:count])
            return
        index = torch.tensor([self.rows, self.sources]).to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))


def build_step_inputs(items: list[ScheduledSeq], block_size: int) -> StepInputs:
    items = sorted(items, key=lambda item: item.seq.slot)
    inputs = StepInputs(items, [], [], [], [], [], [], [], [], [], [], [], [])
    positions: list[list[int] | list[list[int]]] = []
    for item in items:
        seq, start, n = item.seq, item.seq.num_cached, item.num_new
        if seq.images is not None:
            offset = len(inputs.input_ids) - start  # position p of seq is packed row offset + p
            inputs.image_rows.extend(ImageRows(seq, offset + position, feature, count)
                                     for position, feature, count in seq.images.rows_in(start, start + n))
        if seq.head is not None:  # the head reads the prompt's last `positions` tokens, whichever chunks run them
            first = max(start, seq.prompt_len - seq.head.positions)
            if first < start + n:
                row = len(inputs.input_ids) - start
                inputs.head_rows.append(HeadRows(seq, [row + p for p in range(first, start + n)],
                                                 start + n == seq.prompt_len))
        inputs.input_ids.extend(seq.pending_token_ids(n))
        positions.append(seq.rope_positions(start, start + n))
        table = seq.block_table
        inputs.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        inputs.query_lens.append(n)
        inputs.seq_lens.append(start + n)
        inputs.block_tables.append(table)
        if inputs.seg_slots and inputs.seg_slots[-1] == seq.slot:
            inputs.seg_lens[-1] += n
        else:
            inputs.seg_lens.append(n)
            inputs.seg_slots.append(seq.slot)
        if item.samples:
            inputs.logit_rows.append(len(inputs.input_ids) - 1)
            inputs.sampling.append(seq)
    inputs.positions.extend(_pack_positions(positions))
    return inputs


def _pack_positions(parts: list[list[int] | list[list[int]]]) -> list[int] | list[list[int]]:
    """Each sequence's positions in batch order: [num_tokens], or [3][num_tokens] when a part has three
    rows (an M-RoPE chunk over images); one-row parts then repeat in all three. Decode-only steps have
    no image tokens, so they stay one row (what CUDA graphs take)."""
    if all(not part or isinstance(part[0], int) for part in parts):
        return [p for part in parts for p in part]
    rows: list[list[int]] = [[], [], []]
    for part in parts:
        for row, positions in zip(rows, part if part and isinstance(part[0], list) else (part, part, part)):
            row.extend(positions)
    return rows
