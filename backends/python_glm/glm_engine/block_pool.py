"""The KV cache's bookkeeping: a fixed pool of blocks, each holding `block_size` tokens' keys and values, with
prefix reuse.

A full block is identified by a hash of its tokens chained with the hash of the block before it, so equal hashes
mean equal prefixes. A request whose prompt starts with cached blocks takes them (reference counted, no copy)
and computes only the rest; a hit also compares the tokens, so a hash collision can never corrupt an answer.
Freed blocks keep their contents and stay findable until the pool needs them: the free list is kept in order
of release, and allocation takes the least recently released block first (evicting its hash only then).

Invariants (checked by `check_invariants`, and by the tests after every step of a randomized schedule):
- every block is either free (reference count 0, on the free list once) or held (count >= 1, not free);
- a held block's count equals the number of block tables that hold it;
- `cached[h] == b` exactly when block b holds the full block whose chained hash is h;
- a sequence holding n blocks can store up to n * block_size tokens, and its first `num_cached_blocks` blocks
  are full, hashed and never written again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from .sequence import Sequence


def chain_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
    return hash((previous, tokens))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently released first (O(1) removal from the middle on a prefix hit).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chained hash -> block

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

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
            block_id, _ = self.free_blocks.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s blocks, its last block first, so a prompt's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()

    # -- prefix reuse ------------------------------------------------------------------------------------------
    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence with nothing computed, take the cached blocks its tokens start with; returns the number
        of tokens they hold. At least the last token is always left to compute, for its logits."""
        assert seq.num_computed_tokens == 0 and not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        reusable = (seq.num_tokens - 1) // self.block_size
        previous = None
        for index in range(reusable):
            tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            block_hash = chain_hash(previous, tokens)
            block_id = self.cached.get(block_hash)
            if block_id is None or self.block_tokens[block_id] != tokens:
                break
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
            previous = block_hash
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq`'s computed tokens have filled since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = chain_hash(previous, tokens)
            seq.block_hashes.append(block_hash)
            block_id = seq.block_table[index]
            # Another block may already hold the same prefix (computed side by side); the first one stays.
            if block_hash not in self.cached:
                self.cached[block_hash] = block_id
                self.block_hash[block_id] = block_hash
                self.block_tokens[block_id] = tokens

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    # -- checks ------------------------------------------------------------------------------------------------
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        held = [0] * self.num_blocks
        for seq in live:
            assert seq.num_computed_tokens <= len(seq.block_table) * self.block_size, seq.request_id
            assert len(seq.block_hashes) <= seq.num_computed_tokens // self.block_size, seq.request_id
            for block_id in seq.block_table:
                held[block_id] += 1
        for block_id in range(self.num_blocks):
            assert self.ref_counts[block_id] == held[block_id], f"block {block_id}: count != holders"
            assert (self.ref_counts[block_id] == 0) == (block_id in self.free_blocks), f"block {block_id}: free"
        for block_hash, block_id in self.cached.items():
            assert self.block_hash[block_id] == block_hash, f"block {block_id}: hash map out of step"
        assert sum(h is not None for h in self.block_hash) == len(self.cached), "a hashed block is not findable"
