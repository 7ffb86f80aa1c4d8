"""Turning each sequence's last logits into its next token.

Order, per sequence: penalties (repetition, presence, frequency), bad words and the min_tokens ban on
end-of-sequence tokens adjust the logits; then greedy takes the best, or sampling divides by the temperature,
filters by top-k, top-p and min-p, and draws from the sequence's own generator, seeded once per request, so a
seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
    """logits: [len(seqs), vocab] float32 -> one token id per sequence, and its log-probability for the sequences
    that asked (None for the others). Penalties adjust `logits` in place."""
    for row, seq in enumerate(seqs):
        if seq.params.adjusts_logits or seq.num_output_tokens < seq.params.min_tokens:
            logits[row] = adjusted_logits(logits[row], seq)
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
        probs = torch.softmax(scores, dim=-1)
        if params.min_p > 0.0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        if seq.generator is None:
            seq.generator = torch.Generator(device=logits.device).manual_seed(seq.seed)
        tokens[row] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    logprobs: list[float | None] = [None] * len(seqs)
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        chosen = torch.log_softmax(logits[rows], dim=-1).gather(1, tokens[rows, None])[:, 0]
        for row, value in zip(wanted, chosen.tolist()):
            logprobs[row] = value
    return tokens.tolist(), logprobs


def adjusted_logits(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.params
    row = row.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        output = torch.tensor(seq.output_token_ids, device=row.device)
        counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    for word in params.bad_words_ids:
        if len(word) == 1 or tuple(seq.token_ids[-(len(word) - 1):]) == word[:-1]:
            row[word[-1]] = float("-inf")
    if seq.num_output_tokens < params.min_tokens and seq.stop_token_ids:
        row[torch.tensor(sorted(seq.stop_token_ids), device=row.device)] = float("-inf")
    return row


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least top_p."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best token always stays.
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(0, order, sorted_scores)
