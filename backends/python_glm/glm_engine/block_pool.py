"""The KV cache's bookkeeping: a fixed pool of blocks, each holding `block_size` tokens' keys and values.

Invariants (checked by `check_invariants`, and by the tests after every step of a randomized schedule):
- every block is either free (reference count 0, on the free list exactly once) or held (count >= 1, not free);
- a held block's count equals the number of block tables that hold it;
- a sequence holding n blocks can store up to n * block_size tokens.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still take to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table so it can hold `num_tokens` tokens."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: {needed} blocks needed, {self.num_free_blocks} free")
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s blocks, its last block first."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        held = [0] * self.num_blocks
        for seq in live:
            assert seq.num_computed_tokens <= len(seq.block_table) * self.block_size, seq.request_id
            for block_id in seq.block_table:
                held[block_id] += 1
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        for block_id in range(self.num_blocks):
            assert self.ref_counts[block_id] == held[block_id], f"block {block_id}: count != holders"
            assert (self.ref_counts[block_id] == 0) == (block_id in free), f"block {block_id}: free state"
