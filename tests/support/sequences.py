"""Synthetic sequences, for testing the block pool and the scheduler without a model."""

from __future__ import annotations

from glm_engine import SamplingParams
from glm_engine.sequence import Sequence


def sequence(request_id="s", tokens=1, token_ids=None, max_tokens=64) -> Sequence:
    token_ids = list(token_ids or [5] * tokens)
    return Sequence(request_id, token_ids, len(token_ids), SamplingParams(max_tokens=max_tokens), frozenset(), seed=0)
