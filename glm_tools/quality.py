"""Held-out perplexity with the engine's own forward pass: what scripts/bench_quantization.py and the tests measure
quantization by, on the trained demo model."""

from __future__ import annotations

import math

import torch
from tokenizers import Tokenizer

from glm_engine import LLMEngine
from glm_engine.attention import AttentionMetadata
from glm_tools.demo_model import corpus_files
from glm_tools.train_demo import TRAINING_BYTES, split_corpus, token_stream

WINDOW = 256


def held_out_stream(tokenizer: Tokenizer) -> list[int]:
    """The held-out text of glm_tools/train_demo.py (files the demo model never trained on) as token ids."""
    return token_stream(tokenizer, split_corpus(corpus_files(TRAINING_BYTES))[1]).tolist()


def windows(stream: list[int], count: int, size: int = WINDOW) -> list[list[int]]:
    """The first `count` windows of size + 1 tokens (size inputs, each with its next token), one after another."""
    return [stream[start:start + size + 1] for start in range(0, len(stream) - size - 1, size)][:count]


@torch.inference_mode()
def window_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, prefilled at once into blocks 0, 1, ... of the engine's cache (which must
    hold that many)."""
    runner, n = engine.runner, len(ids)
    device = runner.device
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(-(-n // runner.block_size), device=device)[None, :],
        context_lens=torch.tensor([n], device=device), query_lens=[n], host_context_lens=[n])
    hidden = runner.model(torch.tensor(ids, device=device), torch.arange(n, device=device), runner.kv_caches, meta)
    return runner.model.logits(hidden)


def perplexity(engine: LLMEngine, token_windows: list[list[int]]) -> float:
    """exp of the mean next-token loss over the windows, each computed from an empty cache."""
    total, count = 0.0, 0
    for ids in token_windows:
        logits = window_logits(engine, ids[:-1])
        targets = torch.tensor(ids[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(ids) - 1
    return math.exp(total / count)
