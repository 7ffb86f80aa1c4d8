"""Turning each sequence's last logits into its next token: greedy, or temperature / top-k / top-p sampling.

Every sampled row draws from its sequence's own generator, seeded once per request, so a seed gives the same
tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [len(seqs), vocab] float32 -> one token id per sequence."""
    tokens = logits.argmax(dim=-1)
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            continue
        scores = logits[row] / params.temperature
        if 0 < params.top_k < scores.shape[0]:
            kth_best = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth_best, float("-inf"))
        if params.top_p < 1.0:
            scores = _top_p_filter(scores, params.top_p)
        if seq.generator is None:
            seq.generator = torch.Generator(device=logits.device).manual_seed(seq.seed)
        probs = torch.softmax(scores, dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    return tokens.tolist()


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least top_p."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best token always stays.
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(0, order, sorted_scores)
