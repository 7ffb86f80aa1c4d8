"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"  # the engine failed while running it


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


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
    arrival_time: float = field(default_factory=time.monotonic)
    started: bool = False  # it has joined the running batch at least once (a preempted one waits again)
    # Another answer to the same prompt, submitted just before this one: this one starts once the leader's prompt is
    # in the prefix cache, so that it computes only the prompt's last, partial block (Scheduler.schedule).
    leader: Sequence | None = field(default=None, repr=False)
    # Figures for TensorRT-LLM's perf-metric outputs: blocks of the prompt found in the prefix cache when the
    # sequence first started, and when that was (time.time_ns()).
    num_cached_blocks: int = 0
    first_scheduled_ns: int = 0
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
