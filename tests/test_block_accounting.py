"""KV block accounting: the pool's invariants hold after every step, and every block comes back however a
request ends (finished, stopped, aborted, failed, preempted and recomputed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.sequences import sequence

from glm_engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from glm_engine.block_pool import BlockPool


def test_allocate_grows_block_table_by_whole_blocks():
    pool = BlockPool(num_blocks=4, block_size=4)
    seq = sequence()
    pool.allocate(seq, 5)
    assert len(seq.block_table) == 2 and pool.num_free_blocks == 2
    pool.allocate(seq, 8)  # still fits in two blocks
    assert len(seq.block_table) == 2
    pool.allocate(seq, 9)
    assert len(seq.block_table) == 3
    pool.check_invariants([seq])
    pool.free(seq)
    assert seq.block_table == [] and pool.num_free_blocks == 4
    pool.check_invariants([])


def test_exhaustion_is_refused_without_side_effects():
    pool = BlockPool(num_blocks=2, block_size=4)
    a, b = sequence("a"), sequence("b")
    pool.allocate(a, 8)
    assert not pool.can_allocate(b, 1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(b, 1)
    assert b.block_table == [] and pool.num_free_blocks == 0
    pool.check_invariants([a, b])


def test_free_returns_the_tail_first():
    pool = BlockPool(num_blocks=3, block_size=1)
    seq = sequence()
    pool.allocate(seq, 3)
    held = list(seq.block_table)
    pool.free(seq)
    assert list(pool.free_blocks) == held[::-1]


def test_prefix_blocks_are_shared_and_stay_cached_until_needed():
    pool = BlockPool(num_blocks=6, block_size=2)
    first = sequence("first", token_ids=[1, 2, 3, 4, 5])
    pool.allocate(first, 5)
    first.num_computed_tokens = 5
    pool.cache_full_blocks(first)
    assert len(pool.cached) == 2  # [1, 2] and [1, 2][3, 4]; the last block is not full

    second = sequence("second", token_ids=[1, 2, 3, 4, 9, 9])
    assert pool.reuse_cached_prefix(second) == 4
    assert second.block_table == first.block_table[:2]
    assert [pool.ref_counts[b] for b in second.block_table] == [2, 2]
    pool.check_invariants([first, second])

    pool.free(first)
    pool.free(second)
    assert pool.num_free_blocks == 6 and len(pool.cached) == 2  # freed, still findable
    third = sequence("third", token_ids=[1, 2, 3, 4, 7])
    assert pool.reuse_cached_prefix(third) == 4
    pool.free(third)

    hog = sequence("hog", tokens=12)
    pool.allocate(hog, 12)  # needs every block: the cached ones are evicted
    assert pool.cached == {}
    pool.check_invariants([hog])


def test_a_hit_always_leaves_the_last_prompt_token_to_compute():
    pool = BlockPool(num_blocks=4, block_size=2)
    first = sequence("first", token_ids=[1, 2, 3, 4])
    pool.allocate(first, 4)
    first.num_computed_tokens = 4
    pool.cache_full_blocks(first)
    same = sequence("same", token_ids=[1, 2, 3, 4])
    assert pool.reuse_cached_prefix(same) == 2  # not 4: the last token's logits are needed


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory):
    from support.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4-accounting")), "glm4")[0]


request_strategy = st.tuples(
    st.integers(0, 24),  # length of a prefix shared with other requests
    st.integers(1, 24),  # length of the request's own tokens after it
    st.integers(1, 20),  # max_tokens
    st.integers(0, 12),  # arrival step
    st.one_of(st.none(), st.integers(0, 15)),  # abort at step, if any
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request_strategy, min_size=1, max_size=8),
       num_blocks=st.integers(8, 24), budget=st.integers(4, 64), max_seqs=st.integers(1, 6))
def test_randomized_schedule_keeps_invariants_and_frees_everything(glm4_dir, requests, num_blocks, budget, max_seqs):
    engine = LLMEngine(EngineConfig(model_dir=glm4_dir, block_size=4, num_kv_blocks=num_blocks,
                                    max_num_batched_tokens=budget, max_num_seqs=max_seqs))
    generator = torch.Generator().manual_seed(len(requests))
    finished = {}
    step = 0
    shared_prefix = torch.randint(3, 512, (24,), generator=generator).tolist()
    pending = sorted(enumerate(requests), key=lambda item: item[1][3])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][3] <= step:
            index, (shared_len, own_len, max_tokens, _, _) = pending.pop(0)
            own = torch.randint(3, 512, (own_len,), generator=generator).tolist()
            prompt = shared_prefix[:shared_len] + own
            try:
                engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8,
                                                                       seed=index))
            except ValueError:  # can never fit this pool: rejected up front
                finished[f"r{index}"] = FinishReason.ERROR
        for index, (*_, abort_at) in enumerate(requests):
            if abort_at == step and (output := engine.abort_request(f"r{index}")) is not None:
                finished[output.request_id] = output.finish_reason
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.finish_reason
        engine.pool.check_invariants(engine.scheduler.live_sequences())
        step += 1
        assert step < 2000, "the schedule made no progress"
    assert len(finished) == len(requests)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.sequences == {}


def test_a_failed_step_fails_its_requests_and_frees_their_blocks(glm4_dir):
    engine = LLMEngine(EngineConfig(model_dir=glm4_dir, block_size=4, num_kv_blocks=32))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=8))
    engine.step()

    def broken(batch):
        raise RuntimeError("device lost")

    engine.runner.execute = broken
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"a", "b"}
    assert all(o.finished and o.finish_reason is FinishReason.ERROR and "device lost" in o.error for o in outputs)
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_the_answers_to_one_prompt_share_its_blocks(glm4_dir):
    """num_return_sequences / n: the first answer leads; the others start once its prompt's full blocks are cached,
    take them, and compute only the last partial block. Each answer is what a request of its own with the same seed
    gives."""
    engine = LLMEngine(EngineConfig(model_dir=glm4_dir, block_size=4, num_kv_blocks=32))
    prompt = list(range(3, 13))  # 10 tokens: two full blocks and a partial one
    samples = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3).samples()
    for index, params in enumerate(samples):
        engine.add_request(f"a{index}", prompt, params, leader_id="a0" if index else None)
    outputs = {f"a{i}": [] for i in range(3)}

    def step():
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids

    step()
    assert [engine.sequences[f"a{i}"].started for i in range(3)] == [True, False, False]
    step()
    followers = [engine.sequences["a1"], engine.sequences["a2"]]
    assert all(seq.num_cached_blocks == 2 for seq in followers)
    assert engine.pool.num_used_blocks == 3 + 1 + 1  # the leader's three, and one partial block each
    engine.pool.check_invariants(engine.scheduler.live_sequences())
    while engine.has_unfinished_requests():
        step()
    assert engine.pool.num_used_blocks == 0

    alone = LLMEngine(EngineConfig(model_dir=glm4_dir, block_size=4, num_kv_blocks=32, enable_prefix_caching=False))
    assert alone.generate([prompt] * 3, samples) == list(outputs.values())
