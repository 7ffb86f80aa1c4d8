"""The sampler's benchmark cases, shared by scripts/bench_sampler.py (the CPU) and the GPU check: request settings,
shapes of random logits, and sequences to sample for."""

from __future__ import annotations

from glm_engine import sequence

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "GLM-4 default (T 0.8, top_p 0.8)": dict(temperature=0.8, top_p=0.8),
    "T 0.7, top_k 50, top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "T 0.7, top_p 0.9, repetition 1.1": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
}
# Standard deviations of normal random logits: "peaked" puts the top-p set on a few tokens, as a confident model
# does; "flat" spreads it over thousands, the worst case for top-p.
LOGIT_SCALES = {"peaked": 4.0, "flat": 1.0}


def make_sequences(batch: int, settings: dict, vocab: int, version=sequence) -> list:
    """Sequences of 300 prompt and 100 output tokens, each with its own seed, of a version's own classes (the
    `sequence` module of this engine, or of another commit's)."""
    params = version.SamplingParams(max_tokens=200, **settings)
    return [version.Sequence(str(i), [(i + t) % vocab for t in range(400)], 300, params, frozenset({2}), seed=i)
            for i in range(batch)]
