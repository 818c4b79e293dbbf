"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and each sequence's block table.

Block 0 is never handed out: padded rows of captured CUDA-graph batches write their K/V there,
so padding can never overwrite a live sequence's cache.
"""

from __future__ import annotations

from gpu_worker.sequence import Sequence

SCRATCH_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 2, "need the scratch block and at least one more"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def free_tokens(self) -> int:
        return len(self._free) * self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain before `num_new_tokens` more tokens are cached."""
        return max(0, blocks_for(seq.num_cached + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        assert needed <= len(self._free), (needed, len(self._free))
        seq.block_table.extend(self._free.pop() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; its cached tokens are gone (preemption or retirement)."""
        self._free.extend(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_cached = 0
