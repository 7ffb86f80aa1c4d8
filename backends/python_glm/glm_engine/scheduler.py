"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and recompute after preemption: every sequence has
`num_tokens` (prompt + output so far) and `num_computed_tokens` (those in the KV cache); a step gives each
scheduled sequence up to `num_tokens - num_computed_tokens` tokens, within a budget of
`max_num_batched_tokens` per step and `max_num_seqs` running sequences. A sequence whose computed tokens
reach its length this step gets a new token sampled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_pool import BlockPool
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step completes the sequence's known tokens, so its last logits give a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and how many of them were found there.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False

        # Running sequences first, oldest first; when blocks run out, the newest running ones yield theirs.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.pool.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.pool.allocate(seq, seq.num_computed_tokens + num_new)
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                index += 1

        # Then waiting ones, first come first served, unless this step already had to preempt.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.pool.reuse_cached_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.pool.can_allocate(seq, seq.num_computed_tokens + num_new):
                self.pool.free(seq)  # give the cached blocks back; they stay cached
                seq.num_computed_tokens = 0
                break
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit
            self.waiting.popleft()
            self.pool.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV cache; it waits at the front and recomputes prompt + output so far."""
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
