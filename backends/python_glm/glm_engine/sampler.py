"""Turning each sequence's last logits into its next token, for the whole batch at once.

Order: penalties (repetition, presence, frequency), bad words and the min_tokens ban on end-of-sequence tokens
adjust the logits; then greedy rows take the best token, and sampled rows divide by their temperature, are
filtered by top-k, top-p and min-p, and draw. Each of these is one tensor operation over all the rows that use it,
rather than a dozen per row (scripts/bench_sampler.py times both; docs/performance.md has the figures). Rows with
a top-k of at most 256 do all of it on their top-k candidates alone.

The draw inverts each row's cumulative distribution at a number from the sequence's own random stream (Python's
`random`, seeded once per request). So a seed gives the same tokens whatever else is in the batch, and the draws
do not depend on the device.
"""

from __future__ import annotations

import itertools

import torch

from .sequence import Sequence


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], uniforms: list[float | None] | None = None
           ) -> tuple[list[int], list[float | None]]:
    """logits: [len(seqs), vocab] float32 -> one token id per sequence, and its log-probability for the sequences
    that asked (None for the others). Penalties adjust `logits` in place.

    `uniforms`: each row's number for its draw (draw_uniforms); drawn here when not given. A row whose logits hold
    no finite maximum (NaN or infinite: a broken forward pass for that sequence; or every token banned) gets the
    token -1, so that the engine fails that request alone; every setting in its documented range gives a token in
    the vocabulary."""
    adjust_logits(logits, seqs)
    row_max = logits.amax(dim=-1, keepdim=True)  # NaN if any logit of the row is
    if uniforms is None:
        uniforms = draw_uniforms(seqs)
    tokens = choose(logits, row_max, seqs, uniforms)
    tokens = torch.where(torch.isfinite(row_max[:, 0]), tokens, -1)
    logprobs: list[float | None] = [None] * len(seqs)
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        chosen = torch.log_softmax(logits[rows], dim=-1).gather(1, tokens[rows, None].clamp(min=0))[:, 0]
        for row, value in zip(wanted, chosen.tolist()):
            logprobs[row] = value
    return tokens.tolist(), logprobs


def draw_uniforms(seqs: list[Sequence]) -> list[float | None]:
    """Each sampled row's number in [0, 1) for its draw, from the sequence's own stream (None for greedy rows).
    Drawn once per step and sequence, before anything runs, so that rerunning a step draws nothing again."""
    return [None if seq.params.greedy else seq.rng.random() for seq in seqs]


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: the penalties, then the bans (bad words, min_tokens). The penalties touch only the logits of
    tokens a sequence holds, one entry per occurrence, not a [rows, vocab] table of counts."""
    device = logits.device
    rows = [row for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
    if rows:  # prompt and output; a token held twice is written twice with the same value
        row_ids, tokens = occurrences([seqs[row].token_ids for row in rows], rows, device)
        penalty = _per_row([seq.params.repetition_penalty for seq in seqs], logits)[row_ids]
        values = logits[row_ids, tokens]
        # A penalty near 0 sends positive logits to +inf, which would make the row's softmax NaN: the largest
        # finite value keeps them the most likely. (Negative ones may go to -inf: never drawn.)
        penalized = torch.where(values > 0, values / penalty, values * penalty)
        logits[row_ids, tokens] = penalized.clamp(max=torch.finfo(logits.dtype).max)

    rows = [row for row, seq in enumerate(seqs)
            if (seq.params.presence_penalty or seq.params.frequency_penalty) and seq.num_output_tokens]
    if rows:  # output only
        row_ids, tokens = occurrences([seqs[row].output_token_ids for row in rows], rows, device)
        frequency = _per_row([seq.params.frequency_penalty for seq in seqs], logits)[row_ids]
        logits.index_put_((row_ids, tokens), -frequency, accumulate=True)  # once per occurrence
        distinct = torch.unique(row_ids * logits.shape[1] + tokens)
        row_ids, tokens = distinct // logits.shape[1], distinct % logits.shape[1]
        presence = _per_row([seq.params.presence_penalty for seq in seqs], logits)[row_ids]
        logits.index_put_((row_ids, tokens), -presence, accumulate=True)  # once per token

    banned = []  # (row, token) pairs
    for row, seq in enumerate(seqs):
        for word in seq.params.bad_words_ids:
            if len(word) == 1 or tuple(seq.token_ids[-(len(word) - 1):]) == word[:-1]:
                banned.append((row, word[-1]))
        if seq.num_output_tokens < seq.params.min_tokens:
            banned += [(row, token) for token in seq.stop_token_ids]
    if banned:
        banned_rows, banned_tokens = zip(*banned)
        logits[torch.tensor(banned_rows, device=device), torch.tensor(banned_tokens, device=device)] = float("-inf")


def occurrences(token_lists: list[list[int]], rows: list[int], device: torch.device):
    """(row ids, token ids): one entry per token of each list, with the row that list belongs to."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row_ids = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return row_ids, tokens


# A row whose top_k is at most this draws among its top-k tokens alone: after one topk, its work is [rows, top_k]
# instead of [rows, vocabulary].
SMALL_TOP_K = 256


def choose(logits: torch.Tensor, row_max: torch.Tensor, seqs: list[Sequence],
           uniforms: list[float | None]) -> torch.Tensor:
    """One token per row of logits [rows, vocab], each row its own way: greedy, drawn among a small top-k, or
    drawn over the whole vocabulary. The way depends on the row's own settings only, so a seed gives the same
    token whatever shares the batch. row_max: each row's largest logit [rows, 1]."""
    ways = [_way(seq.params.greedy, seq.params.top_k, logits.shape[1]) for seq in seqs]
    if len(set(ways)) == 1:  # all one way: no copy of the rows (a pass over [rows, vocab] saved)
        return ways[0](logits, row_max, seqs, uniforms)
    tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    for way in dict.fromkeys(ways):
        rows = [row for row, its_way in enumerate(ways) if its_way is way]
        index = torch.tensor(rows, device=logits.device)
        tokens[index] = way(logits[index], row_max[index], [seqs[row] for row in rows], [uniforms[row] for row in rows])
    return tokens


def _way(greedy: bool, top_k: int, vocab: int):
    if greedy:
        return _greedy
    return _draw_among_top_k if 0 < top_k <= SMALL_TOP_K and top_k < vocab else _draw_over_vocabulary


def _greedy(logits: torch.Tensor, row_max: torch.Tensor, seqs: list[Sequence], uniforms) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _per_row(values: list, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    return _per_row(values, like)[:, None]


def _scaled(scores: torch.Tensor, best: torch.Tensor, params) -> torch.Tensor:
    """(scores - the row's best) / temperature: at most 0, so that no temperature in range overflows to NaN (a
    tiny one sends all but the best to -inf, a huge one flattens the row)."""
    return (scores - best) / _column([p.temperature for p in params], scores)


def _draw_among_top_k(logits: torch.Tensor, row_max: torch.Tensor, seqs: list[Sequence], uniforms) -> torch.Tensor:
    params = [seq.params for seq in seqs]
    top_k = [p.top_k for p in params]
    scores, candidates = torch.topk(logits, max(top_k), dim=-1)  # most likely first
    beyond_k = torch.arange(max(top_k), device=logits.device)[None, :] >= _column(top_k, candidates)
    scores = _scaled(scores, row_max, params)
    probs = _top_p(torch.softmax(scores.masked_fill(beyond_k, float("-inf")), dim=-1), seqs, already_sorted=True)
    return candidates.gather(1, _min_p_and_invert(probs, seqs, uniforms)[:, None])[:, 0]


def _draw_over_vocabulary(logits: torch.Tensor, row_max: torch.Tensor, seqs: list[Sequence], uniforms
                          ) -> torch.Tensor:
    params = [seq.params for seq in seqs]
    scores = _scaled(logits, row_max, params)

    top_k = [p.top_k if 0 < p.top_k < logits.shape[1] else None for p in params]  # only large ones come here
    if any(top_k):
        most = max(k for k in top_k if k)
        largest = torch.topk(scores, most, dim=-1).values
        kth_best = largest.gather(1, torch.tensor([[(k or most) - 1] for k in top_k], device=logits.device))
        kth_best.masked_fill_(torch.tensor([[k is None] for k in top_k], device=logits.device), float("-inf"))
        scores = scores.masked_fill(scores < kth_best, float("-inf"))

    return _min_p_and_invert(_top_p(torch.softmax(scores, dim=-1), seqs), seqs, uniforms)


def _top_p(probs: torch.Tensor, seqs: list[Sequence], already_sorted: bool = False) -> torch.Tensor:
    if not any(seq.params.top_p < 1.0 for seq in seqs):
        return probs
    return _top_p_filter(probs, _column([seq.params.top_p for seq in seqs], probs), already_sorted)


def _min_p_and_invert(probs: torch.Tensor, seqs: list[Sequence], uniforms: list[float]) -> torch.Tensor:
    """Drop tokens below min_p times the best, then draw: the index of each row's token in `probs`."""
    if any(seq.params.min_p > 0.0 for seq in seqs):
        min_p = _column([seq.params.min_p for seq in seqs], probs)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    # Inverse transform sampling: the first token whose cumulative probability exceeds u * total. That token has
    # a probability above zero, since the running sum grows there; u * total is kept below total, so one exists.
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(_column(uniforms, cdf) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    # A row whose logits were not finite has NaN probabilities, and would index one past the end: sample() reports
    # it as -1 anyway, but it must not fail the other rows' gather.
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def _top_p_cutoff(best: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """best: candidates' probabilities, most likely first. The least likely candidate in each row's top-p set: a
    candidate is in it while the ones ranked above it hold less than top_p (the best one always is)."""
    kept = (best.cumsum(dim=-1) - best) < top_p
    return best.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor, already_sorted: bool = False) -> torch.Tensor:
    """Zero, per row, the tokens outside the smallest set of most likely ones whose probabilities add up to at least
    top_p [rows, 1] (ties at the cut are kept). A row whose top_p is 1 keeps every token.

    Rows `already_sorted` (top-k candidates, most likely first) are read as they are. Otherwise the set is looked
    for among each row's 256 most likely tokens first, and only if some row's set is longer in the whole sorted
    vocabulary: a full sort is most of the sampling time when it runs."""
    vocab = probs.shape[1]
    best = probs if already_sorted else torch.topk(probs, min(256, vocab), dim=-1).values
    cutoff = _top_p_cutoff(best, top_p)
    # A set whose least likely member is the last candidate may go on past the candidates.
    if best.shape[1] < vocab and bool(((cutoff == best[:, -1:]) & (top_p < 1.0)).any()):
        # Non-negative float32 values sort as their bits do as int32, which torch sorts faster on the CPU.
        best = torch.sort(probs.view(torch.int32), dim=-1, descending=True).values.view(probs.dtype)
        cutoff = _top_p_cutoff(best, top_p)
    return probs.masked_fill((probs < cutoff) & (top_p < 1.0), 0.0)
