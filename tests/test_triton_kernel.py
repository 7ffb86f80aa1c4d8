"""The Triton-language paged-attention decode kernel against the torch path, on random block layouts.

Run on the CPU through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 for the session, since Triton
reads it both when imported and when a kernel runs); on CUDA the same kernel is compiled. Skipped where the `triton` package is missing."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets it before triton is imported"

from glm_engine.attention import AttentionMetadata, paged_attention  # noqa: E402
from glm_engine.paged_decode_kernel import paged_decode_attention  # noqa: E402
from glm_tools.gpu_check import random_decode_batch  # noqa: E402  (the GPU check's random block layouts)


@pytest.mark.parametrize("seed, num_heads, num_kv_heads, head_dim, block_size", [
    (0, 4, 2, 16, 4),
    (1, 8, 2, 32, 16),
    (2, 4, 4, 16, 8),  # no grouping
    (3, 8, 1, 64, 16),  # one KV head for all (multi-query)
])
def test_decode_kernel_matches_the_torch_path(seed, num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, tables, context_lens = random_decode_batch(
        num_seqs=5, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_context=45, device=torch.device("cpu"), dtype=torch.float32, seed=seed)
    scale = head_dim ** -0.5
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(5, dtype=torch.long), block_tables=tables, context_lens=context_lens,
        query_lens=[1] * 5, host_context_lens=context_lens.tolist())
    expected = paged_attention(q, k_cache, v_cache, meta, scale)
    got = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_engine_decodes_through_the_kernel_as_transformers_does(tiny_model):
    from support.reference import GREEDY, assert_matches_reference, prompts, run_all

    from glm_engine import EngineConfig, LLMEngine

    model_dir, model = tiny_model
    engine = LLMEngine(EngineConfig(model_dir=model_dir, block_size=8, num_kv_blocks=64, attention_backend="triton"))
    assert engine.runner.decode_kernel == "triton"
    requests = {f"k{i}": p for i, p in enumerate(prompts((3, 17, 9), seed=11))}
    assert_matches_reference(model, requests, run_all(engine, requests), max_tokens=GREEDY.max_tokens)


def test_decode_kernel_in_bfloat16_as_on_cuda():
    """bfloat16 caches and queries, as the engine keeps them on CUDA: the kernel accumulates in float32, so it
    differs from the float32 torch path on the same values by no more than rounding its output to bfloat16."""
    q, k_cache, v_cache, tables, context_lens = random_decode_batch(
        num_seqs=6, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, max_context=70,
        device=torch.device("cpu"), dtype=torch.bfloat16, seed=5)
    scale = 32 ** -0.5
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(6, dtype=torch.long), block_tables=tables, context_lens=context_lens,
        query_lens=[1] * 6, host_context_lens=context_lens.tolist())
    expected = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)
