"""The engine against transformers' own GlmForCausalLM / Glm4ForCausalLM (the `tiny_model` fixture runs both).

The reference decodes each prompt alone with its own KV cache; the engine decodes them batched through the paged
cache. Greedy tokens must be identical and logits close: float32 on the CPU, |difference| <= LOGITS_ATOL. In
bfloat16 (CUDA's default), the engine must stay as close to the float32 reference as transformers' bfloat16 does.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from support.reference import (GREEDY, LOGITS_ATOL, assert_matches_reference, make_engine, prompts, record_logits,
                               reference, run_all)

from glm_engine import LLMEngine, SamplingParams


def test_batched_prompts_of_different_lengths_cross_block_boundaries(tiny_model):
    model_dir, model = tiny_model
    # Block size 8: prompts end before, on and after boundaries; 24 new tokens cross several more.
    requests = {f"p{n}": p for n, p in zip((1, 5, 8, 9, 17, 40), prompts((1, 5, 8, 9, 17, 40)))}
    engine = make_engine(model_dir)
    records = record_logits(engine)
    outputs = run_all(engine, requests)
    assert_matches_reference(model, requests, outputs, records)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_requests_joining_a_running_batch(tiny_model):
    model_dir, model = tiny_model
    requests = {f"r{i}": p for i, p in enumerate(prompts((3, 12, 7, 20), seed=2))}
    engine = make_engine(model_dir)
    records = record_logits(engine)
    outputs = run_all(engine, requests, join_after_steps=5)
    assert_matches_reference(model, requests, outputs, records)


def test_chunked_prefill_under_a_small_token_budget(tiny_model):
    model_dir, model = tiny_model
    requests = {f"c{i}": p for i, p in enumerate(prompts((30, 11, 2), seed=3))}
    # 7 tokens a step: the 30-token prompt is prefilled in five chunks while the others decode.
    engine = make_engine(model_dir, max_num_batched_tokens=7)
    outputs = run_all(engine, requests)
    assert_matches_reference(model, requests, outputs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_and_changes_nothing(tiny_model, prefix_caching):
    model_dir, model = tiny_model
    requests = {f"q{i}": p for i, p in enumerate(prompts((10, 14, 9, 12), seed=4))}
    # 4 sequences growing to ~35 tokens need ~20 blocks of 8; 12 forces the newest ones out and back.
    engine = make_engine(model_dir, num_kv_blocks=12, enable_prefix_caching=prefix_caching)
    outputs = run_all(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_reference(model, requests, outputs)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def count_computed_tokens(engine: LLMEngine) -> dict[str, int]:
    """Wrap the runner so the tokens each request actually computes are counted."""
    computed = defaultdict(int)
    execute = engine.runner.execute

    def counting_execute(step):
        for item in step.scheduled:
            computed[item.seq.request_id] += item.num_new_tokens
        return execute(step)

    engine.runner.execute = counting_execute
    return computed


def test_prefix_reuse_skips_the_cached_prefill_and_changes_nothing(tiny_model):
    model_dir, model = tiny_model
    shared = prompts((40,), seed=7)[0]
    engine = make_engine(model_dir)
    computed = count_computed_tokens(engine)
    first = {"first": shared}
    outputs = run_all(engine, first)
    # Later requests: the same prompt, and the first 35 tokens plus their own.
    later = {"same": shared, "extended": shared[:35] + prompts((6,), seed=8)[0]}
    outputs |= run_all(engine, later)
    assert_matches_reference(model, {**first, **later}, outputs)
    # 40 tokens in blocks of 8: 4 full blocks (32 tokens) are reused, whatever follows them is computed.
    assert engine.scheduler.prefix_hit_tokens == 64
    assert computed["first"] == 40 + 23  # the prompt, then one token per decode step
    assert computed["same"] == 8 + 23 and computed["extended"] == 9 + 23
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_hash_collision_is_caught_by_comparing_tokens(tiny_model, monkeypatch):
    from glm_engine import block_pool

    model_dir, model = tiny_model
    monkeypatch.setattr(block_pool, "chain_hash", lambda previous, tokens: 0)  # every block collides
    engine = make_engine(model_dir)
    requests = {f"h{i}": p for i, p in enumerate(prompts((20, 20, 17), seed=9))}
    outputs = run_all(engine, dict(list(requests.items())[:1]))
    outputs |= run_all(engine, dict(list(requests.items())[1:]))
    assert_matches_reference(model, requests, outputs)


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(tiny_model, block_size):
    model_dir, model = tiny_model
    requests = {f"b{i}": p for i, p in enumerate(prompts((6, 19), seed=5))}
    outputs = run_all(make_engine(model_dir, block_size=block_size), requests)
    assert_matches_reference(model, requests, outputs)


def test_log_probs_match_transformers(tiny_model):
    model_dir, model = tiny_model
    prompt = prompts((11,), seed=10)[0]
    engine = make_engine(model_dir)
    engine.add_request("lp", prompt, SamplingParams(max_tokens=12, stop_token_ids=(), logprobs=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    tokens, logits = reference(model, prompt, 12)
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    got = torch.tensor([lp for o in outputs for lp in o.new_logprobs])
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
    assert outputs[-1].cumulative_logprob == pytest.approx(float(got.sum()), abs=1e-4)


def test_transformers_generate_agrees(tiny_model):
    """The same check through transformers' public generate(do_sample=False)."""
    model_dir, model = tiny_model
    prompt = prompts((13,), seed=6)[0]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
    engine = make_engine(model_dir)
    assert engine.generate([prompt], SamplingParams(max_tokens=16, stop_token_ids=()))[0] == expected


def differences_until_divergence(tokens, logits, reference_tokens, reference_logits) -> torch.Tensor:
    """|logit differences| over the steps up to and including the first token that differs from the reference's:
    after it, the two continue different texts."""
    steps = next((i + 1 for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), len(reference_tokens))
    return (logits[:steps] - reference_logits[:steps]).abs().flatten()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(tiny_model, backend):
    """CUDA's default dtype, run here on the CPU, through both decode attention paths. Rounding to bfloat16 flips
    some greedy tokens in transformers too, so the check is on logits: the engine's mean error against the float32
    reference may be at most 1.25x transformers' own in bfloat16 (measured here: 0.90x to 1.03x). That catches a
    wrong cast or a broken bfloat16 path, not a small loss of precision (norms in bfloat16 gave 1.1x-1.2x)."""
    model_dir, model = tiny_model
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    requests = {f"h{n}": p for n, p in zip((1, 9, 17, 40), prompts((1, 9, 17, 40)))}
    engine = make_engine(model_dir, dtype="bfloat16", attention_backend=backend)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    records = record_logits(engine)
    outputs = run_all(engine, requests)
    engine_errors, transformers_errors = [], []
    for request_id, prompt in requests.items():
        tokens, logits = reference(model, prompt, GREEDY.max_tokens)
        engine_errors.append(differences_until_divergence(
            outputs[request_id], torch.stack(records[request_id]), tokens, logits))
        transformers_errors.append(differences_until_divergence(
            *reference(model16, prompt, GREEDY.max_tokens), tokens, logits))
    engine_error, transformers_error = torch.cat(engine_errors).mean(), torch.cat(transformers_errors).mean()
    assert engine_error <= 1.25 * transformers_error, (engine_error, transformers_error)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
