"""Sampling settings, seeds, stop conditions and request validation."""

from __future__ import annotations

import pytest
import torch

from glm_engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from glm_engine.sampler import adjust_logits, sample
from glm_engine.sequence import Sequence


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from support.checkpoints import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4-sampling")), "glm4")[0]
    return LLMEngine(EngineConfig(model_dir=model_dir, block_size=4, num_kv_blocks=64, max_model_len=128))


PROMPT = [11, 12, 13, 14, 15]
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, stop_token_ids=())


def test_same_seed_same_tokens_whatever_shares_the_batch(engine):
    # A small top-k is drawn among its candidates, the rest over the vocabulary: a mixed batch takes both ways.
    with_top_k = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=77, stop_token_ids=())
    alone = engine.generate([PROMPT], SAMPLED)[0]
    alone_with_top_k = engine.generate([PROMPT], with_top_k)[0]
    others = [SamplingParams(max_tokens=n, temperature=0.7, seed=n, stop_token_ids=()) for n in (3, 9, 20)]
    crowded = engine.generate([[7, 8], PROMPT, [9] * 17, [30, 31, 32], PROMPT],
                              [others[0], SAMPLED, others[1], others[2], with_top_k])
    assert crowded[1] == alone and crowded[4] == alone_with_top_k
    assert engine.generate([PROMPT], SamplingParams(**{**SAMPLED.__dict__, "seed": 99}))[0] != alone


def test_seeded_sampling_is_unchanged_by_preemption(engine):
    """The same sampled requests in a pool so small that sequences are preempted and recomputed: each request's
    random stream goes on where it was, so the texts are those of a roomy pool."""
    requests = [[11 + i, 12, 13, 14 + i, 15] for i in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=i, stop_token_ids=()) for i in range(4)]
    roomy = engine.generate(requests, params)
    tight = LLMEngine(EngineConfig(model_dir=engine.config.model_dir, block_size=4, num_kv_blocks=16,
                                   max_model_len=128))
    assert tight.generate(requests, params) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=12, stop_token_ids=()))[0]
    top_k = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3,
                                                     stop_token_ids=()))[0]
    top_p = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3,
                                                     stop_token_ids=()))[0]
    assert greedy == top_k == top_p


def test_sampler_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0, 4.8]])
    seen_top_k, seen_top_p = set(), set()
    for seed in range(200):
        seq = Sequence("s", [1], 1, SamplingParams(temperature=1.0, top_k=2), frozenset(), seed=seed)
        seen_top_k.update(sample(logits, [seq])[0])
        # The three best hold ~99.6% of the mass; top_p 0.6 keeps exactly the two best.
        seq = Sequence("s", [1], 1, SamplingParams(temperature=1.0, top_p=0.6), frozenset(), seed=seed)
        seen_top_p.update(sample(logits, [seq])[0])
    assert seen_top_k == {1, 2}
    assert seen_top_p == {1, 2}


def test_each_row_of_a_batch_samples_with_its_own_settings():
    """One batch, rows with different filters side by side: each row's draws stay within its own filter."""
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0, 4.8]).repeat(4, 1)
    settings = [dict(top_k=2), dict(top_p=0.6), dict(min_p=0.9), dict(temperature=0.5)]
    seen = [set() for _ in settings]
    for seed in range(200):
        seqs = [Sequence("s", [1], 1, SamplingParams(**{"temperature": 1.0, **kw}), frozenset(), seed=seed + 1000 * i)
                for i, kw in enumerate(settings)]
        for row, token in enumerate(sample(logits.clone(), seqs)[0]):
            seen[row].add(token)
    # min_p 0.9 keeps 5.0 and 4.9 (e^-0.1 = 0.905 of the best) but not 4.8 (0.82); no filter keeps the three best.
    assert seen == [{1, 2}, {1, 2}, {1, 2}, {1, 2, 4}]


@pytest.mark.parametrize("top_k, expected", [
    (0, [0.5, 0.0, 0.3, 0.15, 0.05]),  # over the whole vocabulary
    (3, [0.5 / 0.95, 0.0, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # among the top-k candidates alone
])
def test_draws_follow_the_distribution(top_k, expected):
    """4,000 sequences, each with a seed of its own, in one batch: the tokens' frequencies match softmax(logits / T)
    over the tokens the filters keep."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    temperature = 0.5
    logits = (probs.log() * temperature).repeat(4000, 1)  # softmax(logits / 0.5) == probs
    seqs = [Sequence("s", [1], 1, SamplingParams(temperature=temperature, top_k=top_k), frozenset(), seed=seed)
            for seed in range(4000)]
    counts = torch.bincount(torch.tensor(sample(logits, seqs)[0]), minlength=5).float() / 4000
    assert counts[1] == 0 and (top_k == 0 or counts[4] == 0)
    # 0.025 is over 3 standard deviations at p = 0.5.
    assert torch.allclose(counts, torch.tensor(expected), atol=0.025), counts


def test_a_large_top_k_keeps_exactly_the_k_best():
    """top_k 300 of 1,000 nearly equal tokens (past the 256 that are drawn among directly): every draw is one of
    the 300 best, and the least likely of them are drawn too."""
    logits = torch.linspace(1.0, 0.0, 1000).repeat(3000, 1)  # token i is the (i + 1)-th best
    seqs = [Sequence("s", [1], 1, SamplingParams(temperature=1.0, top_k=300), frozenset(), seed=seed)
            for seed in range(3000)]
    tokens = sample(logits, seqs)[0]
    assert max(tokens) == 299


@pytest.mark.parametrize("sharpness", [8.0, 1.0, 0.1])  # nuclei of a few tokens, of hundreds, of nearly all
def test_top_p_keeps_what_sorting_the_whole_vocabulary_keeps(sharpness):
    """Against the plain definition (sort everything, keep while the mass above is under top_p), with nuclei
    inside and beyond the 256 candidates the filter looks at first, rows with and without top_p in one batch."""
    from glm_engine.sampler import _top_p_filter

    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(6, 1000) * sharpness, dim=-1)
    top_p = torch.tensor([[0.5], [0.9], [1.0], [0.99], [0.3], [0.999]])
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    expected = torch.zeros_like(probs, dtype=torch.bool).scatter_(
        1, order, ((ordered.cumsum(dim=-1) - ordered) < top_p) | (top_p >= 1.0))
    assert torch.equal(_top_p_filter(probs, top_p) > 0, expected)


def test_a_step_where_no_sequence_samples():
    """A step of prompt chunks only hands the sampler no rows."""
    assert sample(torch.zeros(0, 10), []) == ([], [])


class FixedDraw:
    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("u, expected", [(0.0, 1), (0.4999, 1), (0.5, 3), (1 - 2**-53, 3)])
def test_the_draw_inverts_the_cumulative_distribution_and_never_picks_an_impossible_token(u, expected):
    """Probabilities [0, 0.5, 0, 0.5, 0]: zero at both ends and between. u = 0 and u just below 1 (which float32
    rounds to 1) still land on possible tokens."""
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]])
    seq = Sequence("s", [1], 1, SamplingParams(temperature=1.0), frozenset(), seed=0)
    seq.rng = FixedDraw(u)
    assert sample(logits, [seq])[0] == [expected]


def test_penalties_in_a_batch_equal_penalties_alone():
    """Rows with different penalties, bans and none, in one batch, get what each would get alone."""
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    seqs = [
        seq_with(SamplingParams(repetition_penalty=1.3), prompt=(3, 4, 4), output=(9, 3)),
        seq_with(SamplingParams()),
        seq_with(SamplingParams(presence_penalty=0.7, frequency_penalty=-0.2), prompt=(1,), output=(5, 5, 6)),
        seq_with(SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, bad_words_ids=((7,), (6, 8))),
                 prompt=(7, 2), output=(6,)),
        seq_with(SamplingParams(min_tokens=3), output=(2,), stop={11, 12}),
    ]
    batch = logits.clone()
    adjust_logits(batch, seqs)
    for row, seq in enumerate(seqs):
        assert batch[row].tolist() == adjusted(logits[row:row + 1], seq), row
    assert batch[1].tolist() == logits[1].tolist() and batch[4, [11, 12]].tolist() == [float("-inf")] * 2


def adjusted(logits: torch.Tensor, seq: Sequence) -> list[float]:
    """The one-row logits [1, vocab] after the sequence's penalties and bans (on a copy)."""
    logits = logits.clone()
    adjust_logits(logits, [seq])
    return logits[0].tolist()


def seq_with(params: SamplingParams, prompt=(1,), output=(), stop=frozenset()) -> Sequence:
    return Sequence("s", [*prompt, *output], len(prompt), params, frozenset(stop), seed=0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[4.0, -2.0, 3.0, 1.0]])
    seq = seq_with(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    assert sample(logits.clone(), [seq])[0] == [2]  # token 0 falls from 4 to 2, below token 2's 3
    assert adjusted(logits, seq) == [2.0, -4.0, 3.0, 1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    seq = seq_with(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(3,), output=(1, 1, 2))
    assert adjusted(logits, seq) == [0.0, -1.0, -0.75, 0.0]


def test_min_p_keeps_only_tokens_near_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        seq = Sequence("s", [1], 1, SamplingParams(temperature=1.0, min_p=0.5), frozenset(), seed=seed)
        seen.update(sample(logits.clone(), [seq])[0])
    assert seen == {0, 1}  # 0.15 and 0.05 are below 0.5 * 0.5


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 1.0]])  # token 1, a stop token, is by far the best
    early = seq_with(SamplingParams(min_tokens=2), output=(2,), stop={1})
    assert sample(logits.clone(), [early])[0] == [2]
    enough = seq_with(SamplingParams(min_tokens=2), output=(2, 2), stop={1})
    assert sample(logits.clone(), [enough])[0] == [1]


def test_bad_words_ban_the_token_that_would_complete_them():
    logits = torch.zeros(1, 6)
    single = seq_with(SamplingParams(bad_words_ids=((3,),)), output=(1,))
    assert adjusted(logits, single)[3] == float("-inf")
    pair = SamplingParams(bad_words_ids=((1, 4),))
    assert adjusted(logits, seq_with(pair, output=(2, 1)))[4] == float("-inf")  # "1" precedes: 4 banned
    assert adjusted(logits, seq_with(pair, output=(1, 2)))[4] == 0.0  # it does not: 4 allowed


def test_bad_words_through_the_engine(engine):
    free_run = engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=()))[0]
    banned = free_run[3]
    steered = engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=(), bad_words_ids=((banned,),)))[0]
    assert banned not in steered and steered[:3] == free_run[:3]


def test_min_tokens_through_the_engine(engine):
    free_run = engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=()))[0]
    stop = free_run[0]  # would end the answer at once
    assert engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0] == []
    held = engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=(stop,), min_tokens=4))[0]
    assert len(held) >= 4 and stop not in held[:4]


def test_stops_at_end_id_and_does_not_return_it(engine):
    free_run = engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=()))[0]
    stop = free_run[4]
    engine.add_request("stopper", PROMPT, SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == free_run[:free_run.index(stop)]
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.STOP


def test_max_tokens_gives_length(engine):
    engine.add_request("len", PROMPT, SamplingParams(max_tokens=3, stop_token_ids=()))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].num_output_tokens == 3


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
    (SamplingParams(temperature=-0.5), "temperature must be"),
    (SamplingParams(temperature=float("nan")), "temperature must be"),
    (SamplingParams(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (SamplingParams(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (SamplingParams(top_k=-1), "top_k must be"),
    (SamplingParams(stop_token_ids=(10**6,)), "end_id must lie"),
    (SamplingParams(max_tokens=200), "over the model's limit of 128"),
    (SamplingParams(min_p=1.5), r"min_p must lie in \[0, 1\]"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be"),
    (SamplingParams(presence_penalty=3.0), r"presence_penalty must lie in \[-2, 2\]"),
    (SamplingParams(frequency_penalty=-2.5), r"frequency_penalty must lie in \[-2, 2\]"),
    (SamplingParams(max_tokens=4, min_tokens=5), r"min_tokens must lie in \[0, max_tokens=4\]"),
])
def test_bad_settings_are_refused_with_their_name(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPT, params)
    assert not engine.has_unfinished_requests()


def test_bad_prompts_are_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="must lie in"):
        engine.add_request("oov", [1, 99999], SamplingParams())
    with pytest.raises(ValueError, match="over the model's limit"):
        engine.add_request("long", [5] * 120, SamplingParams(max_tokens=16))


def test_requests_larger_than_the_whole_cache_are_refused(engine):
    small = LLMEngine(EngineConfig(model_dir=engine.config.model_dir, block_size=4, num_kv_blocks=4))
    with pytest.raises(ValueError, match="more than the whole cache"):
        small.add_request("huge", [5] * 10, SamplingParams(max_tokens=10))
