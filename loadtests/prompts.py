"""Seeded request mixes for the load tests: prompt and output lengths drawn from ranges, and a scenario where
every prompt starts with the same long system prompt (what prefix reuse is for). Also the names of the Locust
entries the users record, which the runner reads back (the runner cannot import the locustfile: that patches
gevent and grpc)."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Plain words that the demo tokenizer (trained on Python sources) and real GLM tokenizers split into about one
# token each, so that a prompt of n words is about n tokens.
WORDS = ("the model reads a prompt and writes an answer one token at a time while the cache keeps keys and values "
         "for every block of tokens so that later steps need not compute them again the server batches requests "
         "together and streams text back as soon as it is ready").split()
# The Locust entries that are whole requests (their content size is the output tokens); "<name> TTFT" and
# "<name> ITL" hold the timings within them.
REQUEST_NAMES = ("generate", "generate_stream", "grpc_stream", "chat_stream")
# A request the server refused as overloaded is its own entry, "<name> overloaded": not a failure, and not in the
# latency figures of the requests it served.
OVERLOADED = " overloaded"
# The totals of a run, written by the locustfile once Locust has stopped (<csv prefix> + this), in the columns of
# Locust's own <csv prefix>_stats.csv, which Locust rewrites once a second while it runs but not at its end.
FINAL_STATS = "_final_stats.csv"
SYSTEM_PROMPT = ("You are a careful assistant. Answer in plain words, keep to the facts you are given, and say so "
                 "when you do not know. ") * 8


def parse_range(text: str) -> tuple[int, int]:
    """'16-512' -> (16, 512); '64' -> (64, 64)."""
    low, _, high = text.partition("-")
    low, high = int(low), int(high or low)
    if not 0 < low <= high:
        raise ValueError(f"a range is LOW-HIGH with 0 < LOW <= HIGH, got {text!r}")
    return low, high


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


class RequestMix:
    """An endless, reproducible stream of requests: scenario "mixed" (independent prompts) or "shared-prefix"
    (the same system prompt, then a short question)."""

    def __init__(self, seed: int = 0, prompt_words: tuple[int, int] = (16, 512),
                 output_tokens: tuple[int, int] = (16, 256), scenario: str = "mixed"):
        if scenario not in ("mixed", "shared-prefix"):
            raise ValueError(f"scenario must be 'mixed' or 'shared-prefix', got {scenario!r}")
        self._random = random.Random(seed)
        self.prompt_words = prompt_words
        self.output_tokens = output_tokens
        self.scenario = scenario

    def next(self) -> Request:
        rng = self._random
        if self.scenario == "shared-prefix":
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
            prompt = SYSTEM_PROMPT + question + "?"
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*self.prompt_words)))
        return Request(prompt, rng.randint(*self.output_tokens))
