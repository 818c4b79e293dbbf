"""Paged KV-cache bookkeeping: free blocks, each sequence's block table, and prefix caching.

Block 0 is never handed out: padded rows of captured CUDA-graph batches write their K/V there,
so padding can never overwrite a live sequence's cache.

Prefix caching (vLLM/SGLang-style, automatic): once a sequence's block is full, its content hash
(block_hashes.py) maps to it. A sequence being admitted takes the blocks of its longest run of
leading full blocks already mapped, shared and read-only (ref-counted), and prefills from the first
token after them. A block whose last user frees it keeps its hash in an LRU pool: it still counts
as free, and is reused by content until the allocator needs it for something else.
"""

from __future__ import annotations

from collections import OrderedDict

from gpu_worker.block_hashes import block_hash
from gpu_worker.sequence import Sequence

SCRATCH_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        assert num_blocks >= 2, "need the scratch block and at least one more"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # unhashed; pop() hands out low ids first
        self._refs = [0] * num_blocks               # sequences whose block table holds each block
        self._cached: dict[bytes, int] = {}         # content hash -> the block holding that content
        self._hash_of: dict[int, bytes] = {}        # its inverse
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed blocks nobody holds, oldest first
        # Totals since start, for the worker's stats: hit rate = prefix_hit_tokens / prefix_query_tokens.
        self.prefix_hit_tokens = 0                  # prompt tokens admitted from the cache, not computed
        self.prefix_query_tokens = 0                # tokens of the sequences admitted while prefix caching is on
        self.evicted_blocks = 0                     # hashed blocks the allocator took back from the pool

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is published, reusable by hash: held by sequences, or evictable."""
        return len(self._cached)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def free_tokens(self) -> int:
        return self.num_free_blocks * self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain before `num_new_tokens` more tokens are cached."""
        return max(0, blocks_for(seq.num_cached + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        assert needed <= self.num_free_blocks, (needed, self.num_free_blocks)
        seq.block_table.extend(self._allocate() for _ in range(needed))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding `seq`'s longest run of leading full blocks; at least its last
        token is left out, so prefill has a token to compute logits from (a task head's positions: Sequence.tail_to_run)."""
        assert not seq.block_table, "a waiting sequence holds no blocks"
        if not self.prefix_caching:
            return []
        blocks: list[int] = []
        for index in range((seq.num_tokens - seq.tail_to_run) // self.block_size):
            block = self._cached.get(block_hash(seq, index, self.block_size))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_admit(self, prefix: list[int], num_new_tokens: int) -> bool:
        """Whether a sequence reusing `prefix` can then grow by `num_new_tokens`."""
        needed = blocks_for(len(prefix) * self.block_size + num_new_tokens, self.block_size) - len(prefix)
        reclaimed = sum(1 for block in prefix if block in self._evictable)  # taking them leaves the pool
        return needed <= self.num_free_blocks - reclaimed

    def admit(self, seq: Sequence, prefix: list[int], num_new_tokens: int) -> None:
        """Give `seq` the shared `prefix` (its tokens count as cached) and room for `num_new_tokens` more."""
        for block in prefix:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(prefix)
        seq.num_published_blocks = len(prefix)
        seq.num_cached = len(prefix) * self.block_size
        self.prefix_hit_tokens += seq.num_cached
        if self.prefix_caching:
            self.prefix_query_tokens += seq.num_tokens
        self.grow(seq, num_new_tokens)

    def publish(self, seq: Sequence) -> None:
        """Map the content hashes of `seq`'s newly filled blocks to them (after a step)."""
        if not self.prefix_caching or not seq.kv_shareable:
            return
        full = seq.num_cached // self.block_size
        for index in range(seq.num_published_blocks, full):
            digest = block_hash(seq, index, self.block_size)
            if digest not in self._cached:  # else another sequence computed it first: this copy stays private
                block = seq.block_table[index]
                self._cached[digest], self._hash_of[block] = block, digest
        seq.num_published_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; its cached tokens are gone (preemption or retirement)."""
        for block in reversed(seq.block_table):  # the tail first: it is evicted before the shared head
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        seq.block_table.clear()
        seq.num_cached = seq.num_published_blocks = 0
        seq.kv_shareable = True  # a recompute starts afresh

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            self.evicted_blocks += 1
        assert self._refs[block] == 0, block
        self._refs[block] = 1
        return block
