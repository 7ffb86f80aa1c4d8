"""A request's sampling settings, and the rule each one keeps.

RULES is the one definition of what values a request may give: SamplingParams.validate checks them, the request
schema of the Triton models (triton_glm/request_schema.py) describes them in the docs, and the adapters check the
stop and bad words against them before tokenizing anything.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    """Numbers between `low` and `high` (either may be None: unbounded), finite. `text` says it in words when the
    plain interval would not (e.g. "be >= 0 (0 disables it)")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    text: str | None = None

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.high is None:
            return f"be {'above' if self.low_open else 'at least'} {self.low}"
        return f"lie in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def check(self, name: str, value) -> None:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        finite = not isinstance(value, float) or math.isfinite(value)  # math.isfinite overflows on huge ints
        if not (finite and low_ok and high_ok):
            raise ValueError(f"{name} must {self.describe()}, got {value}")


@dataclass(frozen=True)
class StringList:
    """At most `max_items` strings of at most `max_chars` characters each."""

    max_items: int
    max_chars: int

    def describe(self) -> str:
        return f"hold at most {self.max_items} strings of at most {self.max_chars} characters"

    def check(self, name: str, values) -> None:
        longest = max(map(len, values), default=0)
        if len(values) > self.max_items or longest > self.max_chars:
            raise ValueError(f"{name} must {self.describe()}, got {len(values)} (the longest of {longest} characters)")


RULES = {
    "max_tokens": Interval(1),
    "temperature": Interval(0, text="be a finite number >= 0"),
    "top_k": Interval(0, text="be >= 0 (0 disables it)"),
    "top_p": Interval(0, 1, low_open=True),
    "min_p": Interval(0, 1),
    "repetition_penalty": Interval(0, low_open=True, text="be a finite number > 0"),
    "presence_penalty": Interval(-2, 2),
    "frequency_penalty": Interval(-2, 2),
    "min_tokens": Interval(0, text="lie in [0, max_tokens]"),  # the upper end is checked by validate()
    "seed": Interval(0, 2**64, high_open=True, text="lie in [0, 2**64)"),
    # Answers per prompt: each is a sequence of its own, and all share the prompt's KV blocks.
    "n": Interval(1, 64),
    # Stop strings cost the engine thread a few steps of an automaton per character, whatever their number; these
    # bound the automaton a request can build (and bad words the sampler's work per step).
    "stop": StringList(max_items=64, max_chars=128),
    "bad_words": StringList(max_items=64, max_chars=128),
}


# Temperatures below this are greedy: dividing by them leaves nothing but the best token anyway, and float32 rounds
# the smallest to 0.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    # 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy; otherwise logits are divided by it before top-k / top-p.
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0: off
    # > 1 discourages tokens already in the prompt or output (divides positive logits, multiplies negative ones).
    repetition_penalty: float = 1.0
    # Subtracted from the logits of tokens already generated: once (presence) or once per occurrence (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # End-of-sequence tokens cannot be sampled before this many tokens are out.
    min_tokens: int = 0
    # Token sequences that must never be generated: the last token of each is banned when the others precede it.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # Report each new token's log-probability under the model's distribution (after penalties, before the
    # temperature and the filters).
    logprobs: bool = False
    # The same seed and prompt give the same tokens, whatever else shares the batch. None: drawn by the engine.
    seed: int | None = None
    # Tokens that end the sequence; None means the checkpoint's end-of-sequence ids.
    stop_token_ids: tuple[int, ...] | None = None
    # Strings that end the answer, never sent (the output processor finds them; the engine never sees them).
    stop: tuple[str, ...] = ()
    # Answers to this prompt (see samples()).
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def samples(self) -> list[SamplingParams]:
        """The settings of each of the n answers: the same, with seeds seed, seed + 1, ... when a seed is given, so
        that each answer differs from the others and is reproducible."""
        if self.n == 1:
            return [self]
        seeds = [None if self.seed is None else (self.seed + i) % 2**64 for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]

    def validate(self) -> None:
        """Raise ValueError naming the setting that breaks its rule in RULES."""
        for name, rule in RULES.items():
            value = getattr(self, name, None)
            if value is not None:
                rule.check(name, value)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
