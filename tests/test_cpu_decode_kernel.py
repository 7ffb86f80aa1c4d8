"""The C paged-attention decode kernel (glm_engine/cpu_decode_kernel.c): against the torch path on random block
layouts, alone and batched, on one thread and two; how the engine chooses it and what it says when it cannot."""

from __future__ import annotations

import logging

import pytest
import torch

from glm_engine import EngineConfig, LLMEngine
from glm_engine import cpu_decode_kernel
from glm_engine.attention import AttentionMetadata, paged_attention
from glm_engine.cpu_decode_kernel import KernelUnavailable, paged_decode_attention
from glm_engine.model_runner import choose_decode_kernel
from glm_tools.gpu_check import random_decode_batch

CPU = torch.device("cpu")


def torch_path(q, k_cache, v_cache, tables, context_lens, scale):
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.long), block_tables=tables,
                             context_lens=context_lens, query_lens=[1] * len(q),
                             host_context_lens=context_lens.tolist(), decode_kernel="torch")
    return paged_attention(q, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("seed, num_heads, num_kv_heads, head_dim, block_size, max_context", [
    (0, 8, 2, 64, 16, 300),  # the bench model's shape
    (1, 32, 2, 128, 16, 100),  # GLM-4-9B's
    (2, 6, 1, 36, 8, 70),  # a group not a multiple of four, dimensions not a multiple of eight
    (3, 5, 5, 8, 1, 20),  # no grouping, one-slot blocks
    (4, 3, 1, 7, 32, 65),  # fewer heads than four, fewer dimensions than eight
    (5, 12, 2, 20, 4, 1),  # contexts of one token
])
def test_the_kernel_matches_the_torch_path(seed, num_heads, num_kv_heads, head_dim, block_size, max_context):
    q, k_cache, v_cache, tables, context_lens = random_decode_batch(
        num_seqs=7, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_context=max_context, device=CPU, dtype=torch.float32, seed=seed)
    # Queries as the model hands them over: a slice of the fused q/k/v rows, not contiguous.
    q = torch.cat([q, torch.randn(7, 2 * num_kv_heads, head_dim)], dim=1)[:, :num_heads]
    scale = head_dim ** -0.5
    expected = torch_path(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale), expected,
                               atol=2e-6, rtol=1e-5)


def test_a_sequences_output_does_not_depend_on_its_batch_or_the_threads():
    """Bit for bit: each (sequence, KV head) is computed alone, whatever else is in the step and however many
    threads share the work."""
    q, k_cache, v_cache, tables, context_lens = random_decode_batch(
        num_seqs=9, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, max_context=200, device=CPU,
        dtype=torch.float32, seed=7)
    batched = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for b in (0, 4, 8):
            alone = paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], context_lens[b:b + 1], 0.125)
            assert torch.equal(alone[0], batched[b])
    finally:
        torch.set_num_threads(threads)


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """Linked with -ffast-math, a shared object would turn on flush-to-zero for the whole process."""
    cpu_decode_kernel.load()
    tiny = torch.tensor([1e-39]) / 10  # a subnormal float32
    assert tiny.item() != 0.0


def test_auto_picks_the_kernel_on_the_cpu_in_float32_only():
    assert choose_decode_kernel("auto", CPU, torch.float32) == "cpu"
    assert choose_decode_kernel("auto", CPU, torch.bfloat16) == "torch"
    assert choose_decode_kernel("torch", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="attention_backend cpu: the C kernel runs float32 on the CPU, not"):
        choose_decode_kernel("cpu", CPU, torch.float16)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a C compiler and with an empty kernel cache."""
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv(cpu_decode_kernel.CACHE_ENV, str(tmp_path))
    cpu_decode_kernel.load.cache_clear()
    yield
    cpu_decode_kernel.load.cache_clear()


def test_without_a_compiler_auto_falls_back_to_torch_and_says_why(no_compiler, caplog):
    with caplog.at_level(logging.WARNING):
        assert choose_decode_kernel("auto", CPU, torch.float32) == "torch"
    assert "no C compiler: 'no-such-compiler' is not on PATH" in caplog.text
    with pytest.raises(ValueError, match="attention_backend cpu: no C compiler"):
        choose_decode_kernel("cpu", CPU, torch.float32)


def test_an_unwritable_cache_is_named(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(cpu_decode_kernel.CACHE_ENV, str(blocker / "kernels"))
    with pytest.raises(KernelUnavailable, match=f"no writable cache directory.*{cpu_decode_kernel.CACHE_ENV}"):
        cpu_decode_kernel.build()


def test_a_compiler_error_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # on PATH, always fails
    monkeypatch.setenv(cpu_decode_kernel.CACHE_ENV, str(tmp_path))
    with pytest.raises(KernelUnavailable, match="false failed \\(exit status 1\\)"):
        cpu_decode_kernel.build()
    assert list(tmp_path.iterdir()) == []  # no half-written kernel left for the next process


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_engine_decodes_as_transformers_does_with_either_path(tiny_model, backend):
    """Prompts across block boundaries, decoding together (decode-only steps) and beside prefills (mixed steps)."""
    from support.reference import GREEDY, assert_matches_reference, prompts, run_all

    model_dir, model = tiny_model
    engine = LLMEngine(EngineConfig(model_dir=model_dir, block_size=8, num_kv_blocks=64, attention_backend=backend,
                                    max_num_batched_tokens=24))
    assert engine.runner.decode_kernel == backend
    requests = {f"k{i}": p for i, p in enumerate(prompts((3, 17, 9, 30), seed=12))}
    assert_matches_reference(model, requests, run_all(engine, requests), max_tokens=GREEDY.max_tokens)
