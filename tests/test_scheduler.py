"""The scheduler on its own: a block pool and synthetic sequences, no checkpoint and no model. Each step is applied
as the engine applies it: the scheduled tokens are computed, and each sampling sequence gets a token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.sequences import sequence

from glm_engine import FinishReason
from glm_engine.block_pool import BlockPool
from glm_engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from glm_engine.sequence import SequenceStatus


def prompt(request_id: str, length: int):
    """A sequence whose tokens no other request shares (so no prefix is reused unless a test wants it)."""
    first = 1000 * (ord(request_id[0]) - ord("a") + 1)
    return sequence(request_id, token_ids=range(first, first + length))


def apply(scheduler: Scheduler, step: SchedulerOutput, token: int = 7) -> None:
    for item in step.scheduled:
        item.seq.num_computed_tokens = item.start + item.num_new_tokens
        scheduler.pool.cache_full_blocks(item.seq)
    for seq in step.sampling:
        seq.token_ids.append(token)


def plan(step: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, first token computed, tokens computed, samples) of each scheduled sequence, in batch order."""
    return [(item.seq.request_id, item.start, item.num_new_tokens, item.samples) for item in step.scheduled]


def run_step(scheduler: Scheduler) -> list[tuple[str, int, int, bool]]:
    step = scheduler.schedule()
    apply(scheduler, step)
    return plan(step)


def test_chunked_prefill_goes_first_come_first_served_within_the_token_budget():
    scheduler = Scheduler(BlockPool(64, block_size=4), max_num_seqs=8, max_num_batched_tokens=8)
    for request_id, length in (("a", 20), ("b", 5), ("c", 3)):
        scheduler.add(prompt(request_id, length))
    assert run_step(scheduler) == [("a", 0, 8, False)]
    assert run_step(scheduler) == [("a", 8, 8, False)]
    assert run_step(scheduler) == [("a", 16, 4, True), ("b", 0, 4, False)]  # a's last chunk, then b's first
    assert run_step(scheduler) == [("a", 20, 1, True), ("b", 4, 1, True), ("c", 0, 3, True)]
    assert run_step(scheduler) == [("a", 21, 1, True), ("b", 5, 1, True), ("c", 3, 1, True)]  # all decode


def test_what_a_step_says_is_fixed_when_it_is_scheduled():
    """`samples` and `start` do not move when the engine then updates the sequence."""
    scheduler = Scheduler(BlockPool(8, block_size=4), max_num_seqs=4, max_num_batched_tokens=16)
    scheduler.add(prompt("a", 5))
    step = scheduler.schedule()
    before = plan(step)
    apply(scheduler, step)
    assert plan(step) == before == [("a", 0, 5, True)]
    assert step.sampling == [step.scheduled[0].seq] and step.num_tokens == 5


def test_max_num_seqs_bounds_the_running_batch():
    scheduler = Scheduler(BlockPool(64, block_size=4), max_num_seqs=2, max_num_batched_tokens=100)
    for request_id in "abc":
        scheduler.add(prompt(request_id, 3))
    assert [request_id for request_id, *_ in run_step(scheduler)] == ["a", "b"]
    assert [seq.request_id for seq in scheduler.waiting] == ["c"]
    scheduler.finish(scheduler.running[0], FinishReason.STOP)
    assert [request_id for request_id, *_ in run_step(scheduler)] == ["b", "c"]


def test_a_full_pool_preempts_the_newest_running_sequence():
    pool = BlockPool(6, block_size=2)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = (prompt(request_id, 4) for request_id in "abc")
    for seq in (a, b, c):
        scheduler.add(seq)
    assert run_step(scheduler) == [("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 4, True)]  # all 6 blocks
    # Each now needs a third block for its fifth token: c, the newest, gives its two back, and a and b go on.
    assert run_step(scheduler) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [c]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.block_table == []
    assert c.token_ids == [3000, 3001, 3002, 3003, 7]  # it keeps its output, and will recompute prompt and output together
    pool.check_invariants(scheduler.live_sequences())


def test_the_newest_sequence_preempts_itself_when_the_pool_is_full():
    scheduler = Scheduler(BlockPool(4, block_size=2), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = prompt("a", 3), prompt("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # two blocks each: the pool is full
    # a's fourth token fits in its second block; b's fifth needs a third, and b is the newest: it yields its own.
    assert run_step(scheduler) == [("a", 3, 1, True)]
    assert list(scheduler.waiting) == [b] and b.block_table == [] and scheduler.num_preemptions == 1


def test_a_prefix_hit_is_capped_at_the_prompt_length_minus_one():
    pool = BlockPool(8, block_size=4)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    first = sequence("first", token_ids=prompt)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.finish(first, FinishReason.STOP)  # its two full blocks stay cached
    # The same 8 tokens: only the first block is reused, or nothing would be left to compute for the logits.
    scheduler.add(sequence("same", token_ids=prompt))
    assert run_step(scheduler) == [("same", 4, 4, True)]
    # One token more: both blocks are reused.
    scheduler.add(sequence("longer", token_ids=prompt + [19]))
    assert run_step(scheduler)[-1] == ("longer", 8, 1, True)
    assert scheduler.prefix_hit_tokens == 4 + 8


def test_the_budget_checks_can_fail():
    scheduler = Scheduler(BlockPool(4, block_size=4), max_num_seqs=1, max_num_batched_tokens=4)
    seq = sequence("a", tokens=8)
    scheduler.pool.allocate(seq, 8)
    with pytest.raises(AssertionError):  # over the token budget
        scheduler._check(SchedulerOutput([ScheduledSequence(seq, 0, 8, True)]))
    with pytest.raises(AssertionError):  # tokens without blocks to hold them
        scheduler._check(SchedulerOutput([ScheduledSequence(sequence("b", tokens=4), 0, 4, True)]))
    scheduler.running += [seq, sequence("c")]
    with pytest.raises(AssertionError):  # more running sequences than max_num_seqs
        scheduler._check(SchedulerOutput([]))


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=12),
       num_blocks=st.integers(12, 40), block_size=st.sampled_from([1, 2, 4, 8]), max_num_seqs=st.integers(1, 6),
       max_num_batched_tokens=st.integers(1, 48))
def test_random_workloads_keep_every_budget_and_finish(prompts, num_blocks, block_size, max_num_seqs,
                                                        max_num_batched_tokens):
    """(prompt length, output length, arrival step) per request; a pool that holds any one request whole."""
    num_blocks = max(num_blocks, -(-52 // block_size))
    pool = BlockPool(num_blocks, block_size)
    scheduler = Scheduler(pool, max_num_seqs, max_num_batched_tokens)
    arrivals = sorted(((arrival, index, sequence(f"r{index}", tokens=length, max_tokens=output))
                       for index, (length, output, arrival) in enumerate(prompts)), key=lambda item: item[:2])
    finished = 0
    for step_number in range(5000):
        while arrivals and arrivals[0][0] <= step_number:
            scheduler.add(arrivals.pop(0)[2])
        if not (arrivals or scheduler.has_unfinished()):
            break
        step = scheduler.schedule()  # asserts its budgets itself
        assert step.num_tokens <= max_num_batched_tokens and len(scheduler.running) <= max_num_seqs
        for item in step.scheduled:
            assert item.samples == (item.start + item.num_new_tokens == item.seq.num_tokens)
        apply(scheduler, step)
        for seq in step.sampling:
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
                finished += 1
        pool.check_invariants(scheduler.live_sequences())
        assert scheduler.waiting_tokens == sum(seq.num_tokens for seq in scheduler.waiting)  # admission reads it
    assert finished == len(prompts)
    assert pool.num_free_blocks == pool.num_blocks
