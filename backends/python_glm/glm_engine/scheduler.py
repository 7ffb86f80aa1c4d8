"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and recompute after preemption: every sequence has
`num_tokens` (prompt + output so far) and `num_computed_tokens` (those in the KV cache); a step gives each
scheduled sequence up to `num_tokens - num_computed_tokens` tokens, within a budget of
`max_num_batched_tokens` per step and `max_num_seqs` running sequences. A sequence whose computed tokens
reach its length this step gets a new token sampled.

schedule() returns the step as a SchedulerOutput; the engine runs it and then applies its results.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .block_pool import BlockPool
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: it computes tokens [start, start + num_new_tokens) of its token_ids.
    `samples`: the step completes the sequence's known tokens, so its last logits give it a new token."""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, in batch order. Fixed when the scheduler returns it: the engine executes it, then
    applies the results (LLMEngine._apply), and nothing in it changes in between."""

    scheduled: list[ScheduledSequence]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences that get a token from this step, in batch order (the rows of the step's logits)."""
        return [item.seq for item in self.scheduled if item.samples]


class Scheduler:
    """Invariants, asserted after every schedule(): a step computes at most max_num_batched_tokens tokens, at
    least one for every scheduled sequence; at most max_num_seqs sequences run; every scheduled sequence holds
    the blocks for the tokens it computes."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.waiting_tokens = 0  # the tokens of the waiting sequences, which they will compute on joining
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and how many of them were found there.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting_tokens += seq.num_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def schedule(self) -> SchedulerOutput:
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
                scheduled.append(self._schedule(seq, num_new))
                budget -= num_new
                index += 1

        # Then waiting ones, first come first served, unless this step already had to preempt.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_leader(seq):
                break
            hit = self.pool.reuse_cached_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.pool.can_allocate(seq, seq.num_computed_tokens + num_new):
                self.pool.free(seq)  # give the cached blocks back; they stay cached
                seq.num_computed_tokens = 0
                break
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit
            self.waiting.popleft()
            self.waiting_tokens -= seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            if not seq.started:
                seq.started = True
                seq.num_cached_blocks = hit // self.pool.block_size
                seq.first_scheduled_ns = time.time_ns()
            self.running.append(seq)
            scheduled.append(self._schedule(seq, num_new))
            budget -= num_new

        step = SchedulerOutput(scheduled)
        self._check(step)
        return step

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """Another answer to a prompt that its leader (the first answer) is computing now waits until the prompt's
        full blocks are in the prefix cache, then shares them. Only while the leader runs: a waiting or finished
        leader holds nothing up. The sequences behind it wait too (first come, first served); the leader is ahead of
        them all, so that is a step or a few of chunked prefill."""
        leader = seq.leader
        return (leader is not None and self.pool.enable_prefix_caching and leader.status is SequenceStatus.RUNNING
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def _schedule(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        self.pool.allocate(seq, seq.num_computed_tokens + num_new)
        return ScheduledSequence(seq, seq.num_computed_tokens, num_new,
                                 samples=seq.num_computed_tokens + num_new == seq.num_tokens)

    def _check(self, step: SchedulerOutput) -> None:
        assert step.num_tokens <= self.max_num_batched_tokens, (step.num_tokens, self.max_num_batched_tokens)
        assert len(self.running) <= self.max_num_seqs, (len(self.running), self.max_num_seqs)
        for item in step.scheduled:
            assert item.num_new_tokens >= 1, item.seq.request_id
            assert item.start + item.num_new_tokens <= len(item.seq.block_table) * self.pool.block_size, \
                item.seq.request_id

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV cache; it waits at the front and recomputes prompt + output so far."""
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.waiting_tokens += seq.num_tokens
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.waiting_tokens -= seq.num_tokens
        self.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
