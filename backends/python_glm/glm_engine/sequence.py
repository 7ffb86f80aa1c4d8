"""One request's state as it moves through the engine, and the sampling settings it came with."""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"  # the engine failed while running it


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    # 0 means greedy; otherwise logits are divided by it before top-k / top-p filtering.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the setting that is out of range."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must lie in [0, 2**64), got {self.seed}")


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. `token_ids` is prompt + output; the KV cache holds the first
    `num_computed_tokens` of them. Each step schedules tokens so that the second catches up with the first."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int]
    seed: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks at the head of block_table that are registered for prefix reuse.
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    # The sampler's draws; kept across preemption, so recomputing a sequence does not change what it samples.
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
