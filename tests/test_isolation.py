"""No request can harm another inside the engine: a step that fails is rerun without the request that makes it
fail, a request whose logits are broken fails alone, and no setting in its documented range makes the sampler
return a token outside the vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.checkpoints import make_tiny_checkpoint
from support.reference import make_engine, prompts

from glm_engine import FinishReason, SamplingParams
from glm_engine.sampler import sample
from glm_engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=12, stop_token_ids=())
SAMPLED = SamplingParams(max_tokens=12, stop_token_ids=(), temperature=0.9, top_p=0.9, seed=7)
REQUESTS = {f"r{i}": (prompt, GREEDY if i % 2 else SAMPLED)
            for i, prompt in enumerate(prompts((5, 17, 9, 30), seed=11))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4-isolation")), "glm4")[0]


def run(engine, requests: dict, poison=None, join_after_steps: int = 3) -> dict:
    """Run the requests, the poison (prompt, params) joining the running batch after some steps; returns each
    request's (tokens, finish reason, error)."""
    results = {request_id: ([], None, None) for request_id in [*requests, *(["poison"] if poison else [])]}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    steps = 0
    while engine.has_unfinished_requests() or (poison and steps <= join_after_steps):
        if poison and steps == join_after_steps:
            engine.add_request("poison", *poison)
        for output in engine.step():
            tokens, _, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason, output.error)
        steps += 1
    return results


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each request's tokens when it runs alone."""
    return {request_id: run(make_engine(model_dir), {request_id: request})[request_id][0]
            for request_id, request in REQUESTS.items()}


def poison_the_forward_pass(engine):
    """The forward pass raises whenever the poison request is in the step, as a request that breaks it would."""
    execute = engine.runner.execute

    def execute_unless_poisoned(step):
        if any(item.seq.request_id == "poison" for item in step.scheduled):
            raise RuntimeError("poisoned input")
        return execute(step)

    engine.runner.execute = execute_unless_poisoned


def poison_the_logits(engine):
    """The poison request's logits come back NaN, as from a numerically broken forward pass."""
    execute = engine.runner.execute

    def execute_with_nan(step):
        logits = execute(step)
        with torch.inference_mode():  # the runner's logits are inference tensors
            for row, seq in enumerate(step.sampling):
                if seq.request_id == "poison":
                    logits[row] = float("nan")
        return logits

    engine.runner.execute = execute_with_nan


@pytest.mark.parametrize("poison, message", [(poison_the_forward_pass, "engine step failed: poisoned input"),
                                             (poison_the_logits, "not finite")])
def test_a_fault_in_one_request_fails_it_alone(model_dir, alone, poison, message):
    engine = make_engine(model_dir)
    poison(engine)
    results = run(engine, REQUESTS, poison=(prompts((7,), seed=3)[0], GREEDY))
    tokens, reason, error = results.pop("poison")
    assert reason is FinishReason.ERROR and message in error
    for request_id, (tokens, reason, error) in results.items():
        assert error is None and reason is FinishReason.LENGTH, request_id
        assert tokens == alone[request_id], request_id  # greedy and seeded sampled alike
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and engine.sequences == {}


def test_a_step_that_fails_whoever_runs_fails_every_request(model_dir):
    engine = make_engine(model_dir)

    def broken(step):
        raise RuntimeError("device lost")

    engine.runner.execute = broken
    results = run(engine, REQUESTS)
    assert all(reason is FinishReason.ERROR and "device lost" in error for _, reason, error in results.values())
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# The ends of every documented range, and values inside them that stress the arithmetic.
EXTREME_SETTINGS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-45, 1e-6, 1e-5, 0.5, 1.0, 1e30, 3.4e38]),
    "top_k": st.sampled_from([0, 1, 2, 255, 256, 257, 511, 512, 10**9]),
    "top_p": st.sampled_from([1e-45, 1e-6, 0.5, 1.0]),
    "min_p": st.sampled_from([0.0, 1e-45, 0.5, 1.0]),
    "repetition_penalty": st.sampled_from([1e-45, 1e-3, 1.0, 1e3, 3.4e38]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "min_tokens": st.sampled_from([0, 5]),
    "seed": st.sampled_from([0, 2**64 - 1]),
})


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(EXTREME_SETTINGS, min_size=1, max_size=4),
       scale=st.sampled_from([1e-30, 1.0, 30.0, 1e30, 3e38]), masked=st.sampled_from([0, 1, 511]),
       seed=st.integers(0, 2**16))
def test_no_setting_in_range_gives_a_token_outside_the_vocabulary(rows, scale, masked, seed):
    """Random finite logits of any scale, up to float32's largest, some tokens already at -inf; a batch of rows at
    extreme settings. Each row gets a token in the vocabulary that was possible (its logit not -inf) and not banned,
    with a log-probability that is not NaN; or -1 when its bans leave no token at all."""
    vocab = 512
    generator = torch.Generator().manual_seed(seed)
    largest = torch.finfo(torch.float32).max
    logits = (torch.randn(len(rows), vocab, generator=generator, dtype=torch.float64) * scale).clamp(
        -largest, largest).float()
    logits[:, torch.randperm(vocab, generator=generator)[:masked]] = float("-inf")
    seqs = []
    for index, settings_ in enumerate(rows):
        params = SamplingParams(max_tokens=16, logprobs=True, bad_words_ids=((3,), (4, 5)), **settings_)
        params.validate()
        # Prompt [5, 6, 6], output [3, 4]: 5 would complete the bad word (4, 5); 3 is one.
        seqs.append(Sequence(f"s{index}", [5, 6, 6, 3, 4], 3, params, frozenset({7}), seed=params.seed))
    possible = logits.clone()
    tokens, logprobs = sample(logits, seqs)
    for row, (token, logprob) in enumerate(zip(tokens, logprobs)):
        # Banned: the bad word 3, the token 5 that would complete (4, 5), the stop token before min_tokens.
        banned = {3, 5} | ({7} if rows[row]["min_tokens"] > 2 else set())
        allowed = set((possible[row] > float("-inf")).nonzero().flatten().tolist()) - banned
        if not allowed:  # the request's own bans leave nothing: it fails alone, with no token
            assert token == -1, (rows[row], token)
            continue
        assert token in allowed, (rows[row], token)
        assert not math.isnan(logprob), rows[row]


@pytest.mark.parametrize("broken", [float("nan"), float("inf")])
def test_rows_with_broken_logits_get_no_token_and_leave_the_others_alone(broken):
    """A row with a NaN or +inf logit (a broken forward pass) gets -1, which the engine turns into that request's
    error; the other rows of the batch sample as they would alone, whichever way they sample."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=generator)
    settings_ = [dict(temperature=0.0), dict(temperature=0.8, top_k=5), dict(temperature=0.8, top_p=0.9),
                 dict(temperature=0.8, top_k=5)]

    def seqs():
        return [Sequence(f"s{i}", [1, 2], 1, SamplingParams(logprobs=True, **kw), frozenset(), seed=i)
                for i, kw in enumerate(settings_)]

    alone = [sample(logits[row:row + 1].clone(), seqs()[row:row + 1]) for row in range(4)]
    damaged = logits.clone()
    damaged[1, 17] = damaged[2, 3] = broken
    tokens, logprobs = sample(damaged, seqs())
    assert tokens[1] == tokens[2] == -1
    for row in (0, 3):
        assert ([tokens[row]], [logprobs[row]]) == alone[row]
