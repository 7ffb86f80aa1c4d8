"""The C kernels for the CPU: paged-attention decode (glm_engine/cpu_decode_kernel.c) against the torch path on random
block layouts, the float32 linear layer (cpu_linear_kernel.c) against a float64 product, the int8 layer
(cpu_int8_kernel.c, its VNNI and AVX2 builds) against the exact integer product of what it quantized; alone and
batched, on one thread and more; how they are built (c_kernels.py), how the engine chooses them and what it says
when it cannot."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from support.kernels import int8_kernel_or_skip

from glm_engine import EngineConfig, LLMEngine
from glm_engine import (c_kernels, cpu_decode_kernel, cpu_elementwise_kernel, cpu_int8_kernel, cpu_linear_kernel,
                        cpu_prefill_kernel)
from glm_engine.attention import AttentionMetadata, _prefill_attention, paged_attention, write_kv
from glm_engine.c_kernels import KernelUnavailable
from glm_engine.cpu_info import cpu_flags
from glm_engine.cpu_decode_kernel import paged_decode_attention
from glm_engine.cpu_prefill_kernel import paged_prefill_attention
from glm_engine.glm_model import MLP, Linear, RMSNorm, RotaryEmbedding
from glm_engine.model_runner import choose_decode_kernel, choose_layer_kernels
from glm_engine.quantization import int8_cpu_kernel, quantize_weight, requantize
from glm_tools.gpu_check import random_decode_batch

CPU = torch.device("cpu")


@contextlib.contextmanager
def torch_threads(count: int):
    """torch (and so the kernel) on `count` threads for a while."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    # 7 sequences on one thread make an item a sequence; on two or more, an item a KV head.
    for threads in (1, 2):
        with torch_threads(threads):
            torch.testing.assert_close(paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale),
                                       expected, atol=2e-6, rtol=1e-5)


def test_a_sequences_output_does_not_depend_on_its_batch_or_the_threads():
    """Bit for bit: each (sequence, KV head) is computed alone, whatever else is in the step, whether the kernel
    takes a sequence's KV heads together (many sequences a thread) or one by one, and however many threads share
    the work."""
    q, k_cache, v_cache, tables, context_lens = random_decode_batch(
        num_seqs=9, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, max_context=200, device=CPU,
        dtype=torch.float32, seed=7)
    with torch_threads(1):  # 9 sequences on one thread: an item a sequence
        batched = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125)
        for b in (0, 4, 8):  # one sequence: an item a KV head
            alone = paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], context_lens[b:b + 1], 0.125)
            assert torch.equal(alone[0], batched[b])
    for threads in (2, 3):  # 9 sequences on three threads: an item a KV head
        with torch_threads(threads):
            assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125), batched)


def random_sequence(seed, num_heads, num_kv_heads, head_dim, block_size, context_len, new_tokens):
    """One sequence's context in a pool of scattered blocks, and queries for its last new_tokens tokens, as the
    model hands them over (a slice of the fused q/k/v rows, not contiguous)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-context_len // block_size)
    pool = (2 * blocks + 3, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(pool, generator=generator), torch.randn(pool, generator=generator)
    table = torch.randperm(pool[0], generator=generator)[:blocks]
    qkv = torch.randn(new_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    return qkv[:, :num_heads], k_cache, v_cache, table


@pytest.mark.parametrize("seed, num_heads, num_kv_heads, head_dim, block_size, context_len, new_tokens", [
    (0, 8, 2, 64, 16, 300, 300),  # the bench model's shape, a whole prompt
    (1, 8, 2, 64, 16, 265, 151),  # the rest of a prompt after a cached prefix, or a chunk
    (2, 32, 2, 128, 16, 70, 70),  # GLM-4-9B's
    (3, 6, 1, 36, 8, 45, 9),  # a group not a multiple of four, dimensions not a multiple of the panel
    (4, 5, 5, 8, 1, 20, 20),  # no grouping, one-slot blocks
    (5, 3, 1, 7, 32, 65, 2),  # fewer heads than four, fewer dimensions than eight, two new tokens
])
def test_the_prefill_kernel_matches_the_torch_path(seed, num_heads, num_kv_heads, head_dim, block_size,
                                                    context_len, new_tokens):
    q, k_cache, v_cache, table = random_sequence(seed, num_heads, num_kv_heads, head_dim, block_size, context_len,
                                                 new_tokens)
    scale = head_dim ** -0.5
    expected = _prefill_attention(q, k_cache, v_cache, table, context_len, scale)
    for threads in (1, 2):
        with torch_threads(threads):
            torch.testing.assert_close(paged_prefill_attention(q, k_cache, v_cache, table, context_len, scale),
                                       expected, atol=2e-6, rtol=1e-5)


def test_a_prompt_token_attends_the_same_whether_the_prompt_came_whole_or_in_chunks():
    """Bit for bit: a token's scores and output are sums in one order whatever its tile, its chunk or the threads
    (so chunked prefill and prefix caching change nothing), in the AVX-512 build and the narrower one alike."""
    q, k_cache, v_cache, table = random_sequence(7, 8, 2, 64, 16, 200, 200)
    builds = [()] + ([("-mno-avx512f",)] if "avx512f" in (cpu_flags() or ()) else [])
    for flags in builds:
        whole = paged_prefill_attention(q, k_cache, v_cache, table, 200, 0.125, extra_flags=flags)
        for start, end in ((0, 37), (37, 38), (38, 150), (150, 200)):  # chunks, one of a single token
            for threads in (1, 2):
                with torch_threads(threads):
                    chunk = paged_prefill_attention(q[start:end], k_cache, v_cache, table, end, 0.125,
                                                    extra_flags=flags)
                assert torch.equal(chunk, whole[start:end])


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone():
    """Linked with -ffast-math, a shared object would turn on flush-to-zero for the whole process."""
    for kernel in (cpu_decode_kernel, cpu_prefill_kernel, cpu_linear_kernel, cpu_elementwise_kernel):
        kernel.load()
    with contextlib.suppress(KernelUnavailable):  # AVX2 only
        cpu_int8_kernel.load()
    tiny = torch.tensor([1e-39]) / 10  # a subnormal float32
    assert tiny.item() != 0.0


def test_auto_picks_the_kernel_on_the_cpu_in_float32_only():
    assert choose_decode_kernel("auto", CPU, torch.float32) == "cpu"
    assert choose_decode_kernel("auto", CPU, torch.bfloat16) == "torch"
    assert choose_decode_kernel("torch", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="attention_backend cpu: the C kernel runs float32 on the CPU, not"):
        choose_decode_kernel("cpu", CPU, torch.float16)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 95, 96, 97, 200])
@pytest.mark.parametrize("out_features, in_features, bias", [
    (768, 512, True),  # the bench model's fused q/k/v, with GLM-4's bias
    (512, 1376, False),  # its down projection
    (50, 33, True),  # outputs not a multiple of the 16-wide panels, odd inputs
    (7, 1, False),  # fewer outputs than a panel, one input
])
def test_the_linear_kernel_matches_a_float64_product(rows, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, weight = torch.randn(rows, in_features, generator=generator), torch.randn(out_features, in_features,
                                                                                 generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    packed = cpu_linear_kernel.pack_weight(weight)
    # 200 rows span three of the kernel's row blocks (96); 1-5 rows take its smaller tiles.
    got = cpu_linear_kernel.linear(x, packed, b, out_features)
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
    with torch_threads(1):
        assert torch.equal(cpu_linear_kernel.linear(x, packed, b, out_features), got)


def test_the_linear_kernel_gives_the_same_bits_with_or_without_avx_512():
    """The AVX-512 build's wider tiles (8 rows x 32 outputs, against AVX2's 6 x 16) sum each output in the same
    order: the same bits, whatever the CPU (built both ways where this one has AVX-512)."""
    if "avx512f" not in (cpu_flags() or ()):
        pytest.skip("this CPU has no AVX-512: only the 6 x 16 tiles can be built")
    narrow = ("-mno-avx512f",)
    assert cpu_linear_kernel.load()[2] == 32 and cpu_linear_kernel.load(narrow)[2] == 16
    x, weight, bias = torch.randn(100, 200), torch.randn(77, 200), torch.randn(77)
    wide = cpu_linear_kernel.linear(x, cpu_linear_kernel.pack_weight(weight), bias, 77)
    assert torch.equal(cpu_linear_kernel.linear(x, cpu_linear_kernel.pack_weight(weight, narrow), bias, 77, narrow),
                       wide)


def test_a_tokens_linear_output_does_not_depend_on_its_batch():
    """Bit for bit: each output is one sum over the inputs in order, whatever tile or row block the token falls in."""
    x, weight = torch.randn(100, 64), torch.randn(40, 64)
    packed = cpu_linear_kernel.pack_weight(weight)
    batched = cpu_linear_kernel.linear(x, packed, None, 40)
    for first, count in ((0, 1), (3, 4), (90, 10), (50, 6)):
        alone = cpu_linear_kernel.linear(x[first:first + count], packed, None, 40)
        assert torch.equal(alone, batched[first:first + count])


INT8_BUILDS = {"native": (), "vnni": cpu_int8_kernel.WITHOUT_AMX, "avx2": ("-mno-avx512f",)}


@pytest.fixture(params=list(INT8_BUILDS))
def int8_build(request) -> tuple[str, ...]:
    """The int8 kernel's extra compiler flags: this CPU's build (AMX, VNNI, else 7-bit AVX2), and each narrower one
    this CPU can run but would not build."""
    flags = INT8_BUILDS[request.param]
    kernel = int8_kernel_or_skip(flags)
    if flags and cpu_int8_kernel.load()[2:] == kernel[2:]:  # the same panel, range and padding
        pytest.skip(f"this CPU's own build is the {request.param} one")
    return flags


def int8_layer(out_features: int, in_features: int, seed: int, flags: tuple[str, ...]):
    """A random weight in the build's range, packed: (float weight, values, scales, packed, compensation)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    values, scales = requantize(*quantize_weight(weight, "int8"), cpu_int8_kernel.load(flags).value_max)
    return weight, values, scales, *cpu_int8_kernel.pack_weight(values, flags)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 9, 13, 95, 96, 97, 200])
@pytest.mark.parametrize("out_features, in_features, bias", [
    (768, 512, True),  # the bench model's fused q/k/v, with GLM-4's bias
    (512, 1376, False),  # its down projection
    (37, 1000, True),  # outputs not a multiple of the panels (16 / 32), inputs not of the 8-wide steps
    (7, 3, False),  # fewer outputs than a panel, fewer inputs than a step
])
def test_the_int8_kernel_sums_exactly_what_it_quantized(int8_build, rows, out_features, in_features, bias):
    """Activations quantized per token to +-top (127 or 63: the build's) as quantize_rows would (scale max|x| / top,
    within half a step), then the exact integer product scaled per token and channel: only the float scaling may
    round (-ffast-math reorders its multiplies)."""
    top = cpu_int8_kernel.load(int8_build).value_max
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    x[0] *= 50  # an outlier token costs the others nothing
    _, values, scales, packed, compensation = int8_layer(out_features, in_features, rows, int8_build)
    assert values.abs().max() <= top
    b = torch.randn(out_features, generator=generator) if bias else None
    scratch = torch.empty(rows, cpu_int8_kernel.padded(in_features, int8_build), dtype=torch.uint8), torch.empty(rows)
    got = cpu_int8_kernel.linear(x, packed, compensation, scales, b, scratch, int8_build)
    x_values, x_scales = scratch[0][:, :in_features].long() - (top + 1), scratch[1]
    torch.testing.assert_close(x_scales, x.abs().amax(dim=1) / top, rtol=1e-6, atol=0)
    assert x_values.abs().max() <= top and ((x / x_scales[:, None] - x_values).abs() <= 0.5 + 1e-4).all()
    exact = (x_values.double() @ values.double().t()) * x_scales.double()[:, None] * scales.double()
    if b is not None:
        exact += b.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    with torch_threads(1):
        assert torch.equal(cpu_int8_kernel.linear(x, packed, compensation, scales, b, None, int8_build), got)


def test_the_int8_kernel_neither_saturates_nor_loses_a_token_to_its_batch(int8_build):
    """Every product at its largest (activations and weights all at the build's limit, 4,096 inputs) sums exactly;
    against float32 it stays within 1.5% (8 bits) or 3% (7 bits) on average; a token's result is the same bits alone
    or in any batch."""
    kernel = cpu_int8_kernel.load(int8_build)
    weight = torch.full((40, 4096), 0.5)
    weight[1::2] = -0.5
    values, scales = requantize(*quantize_weight(weight, "int8"), kernel.value_max)
    packed = cpu_int8_kernel.pack_weight(values, int8_build)
    out = cpu_int8_kernel.linear(torch.ones(3, 4096), *packed, scales, None, None, int8_build)
    assert torch.equal(out, (torch.ones(3, 4096) @ weight.t()))  # +-2048: integers, exact in float32 too

    x = torch.randn(100, 512)
    weight, values, scales, packed, compensation = int8_layer(300, 512, 3, int8_build)
    batched = cpu_int8_kernel.linear(x, packed, compensation, scales, None, None, int8_build)
    reference = x @ weight.t()
    error = ((batched - reference).abs().mean() / reference.abs().mean()).item()
    assert error < (0.015 if kernel.value_max == 127 else 0.03), error
    for first, count in ((0, 1), (3, 4), (90, 10), (50, 6)):
        alone = cpu_int8_kernel.linear(x[first:first + count], packed, compensation, scales, None, None, int8_build)
        assert torch.equal(alone, batched[first:first + count])


@pytest.mark.parametrize("rows", [1, 3, 4, 15, 16, 17, 32, 33, 70])
def test_the_amx_build_gives_the_vnni_builds_bits(rows):
    """The same integer sums made by tile instructions: the same outputs, for every count of 16-token tiles and
    their remainders, inputs not a multiple of a tile's 64 and outputs not of the 32-wide panel."""
    if not cpu_int8_kernel.load().uses_amx:
        pytest.skip("this CPU's int8 kernel is not the AMX build")
    int8_kernel_or_skip(cpu_int8_kernel.WITHOUT_AMX)
    x = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(200)
    outputs = []
    for flags in ((), cpu_int8_kernel.WITHOUT_AMX):
        _, _, scales, packed, compensation = int8_layer(200, 1000, 5, flags)
        outputs.append(cpu_int8_kernel.linear(x, packed, compensation, scales, bias, None, flags))
    assert torch.equal(*outputs)


def test_the_int8_kernel_is_built_without_amx_where_linux_refuses_the_tiles(monkeypatch, caplog):
    """Linux answers a process's request for AMX tiles with an error where it cannot give them (before 5.16, or a
    sandbox that forbids it): the kernel is then the VNNI or AVX2 build, and the log says why."""
    int8_kernel_or_skip()
    build_with_amx = cpu_int8_kernel.load_library

    def refusing(source, extra_flags=()):
        library = build_with_amx(source, extra_flags)
        if not set(cpu_int8_kernel.WITHOUT_AMX) <= set(extra_flags):
            library.linear_i8_init = lambda: errno.EPERM
        return library

    monkeypatch.setattr(cpu_int8_kernel, "load_library", refusing)
    cpu_int8_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            kernel = cpu_int8_kernel.load()
        assert not kernel.uses_amx
        assert f"refused this process AMX tiles ({os.strerror(errno.EPERM)})" in caplog.text
        _, _, scales, packed, compensation = int8_layer(64, 128, 1, ())
        out = cpu_int8_kernel.linear(torch.ones(3, 128), packed, compensation, scales, None)
        assert out.shape == (3, 64) and torch.isfinite(out).all()
    finally:
        cpu_int8_kernel.load.cache_clear()


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 512: enough elements for the threads to share the rows
def test_the_norm_and_activation_kernels_match_torch(rows):
    generator = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 512, generator=generator), torch.randn(rows, 512, generator=generator)
    weight, gate_up = torch.randn(512, generator=generator), torch.randn(rows, 2 * 1376, generator=generator) * 4
    norm = RMSNorm(512, 1e-5)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        expected_alone, (expected, expected_sum) = norm(x), norm(x, residual)
        norm.c_kernel = True
        got_alone, (got, got_sum) = norm(x), norm(x, residual)
    torch.testing.assert_close(got_alone, expected_alone, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    assert torch.equal(got_sum, expected_sum)  # one float addition: exact either way
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_elementwise_kernel.silu_and_mul(gate_up), up * torch.nn.functional.silu(gate),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim, rotary_dim", [
    (1, 8, 2, 64, 32),  # the bench model's shape (GLM-4: half of each head rotated)
    (300, 4, 1, 16, 16),  # every channel rotated, enough rows for the threads
    (7, 3, 3, 10, 4),  # no grouping, odd sizes
])
def test_the_rotary_and_kv_store_kernel_matches_torch(tokens, heads, kv_heads, head_dim, rotary_dim):
    """Queries and keys rotated as RotaryEmbedding.rotate does, keys and values stored as write_kv does; no other slot
    of the cache touched."""
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    slots = torch.randperm(80 * 4, generator=generator)[:tokens]
    k_cache, v_cache = (torch.randn(80, 4, kv_heads, head_dim, generator=generator) for _ in range(2))
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]  # for torch, then for the kernel
    rotary = RotaryEmbedding(SimpleNamespace(rotary_dim=rotary_dim, rope_theta=10000.0))
    angles = rotary.angles(positions, torch.float32)
    q, k = rotary.rotate(qkv[:, :heads + kv_heads], angles).split([heads, kv_heads], dim=1)
    write_kv(caches[0], caches[1], k, qkv[:, heads + kv_heads:], slots)
    cpu_elementwise_kernel.rotary_and_store_kv(qkv, heads, rotary_dim, angles, slots, caches[2], caches[3])
    torch.testing.assert_close(qkv[:, :heads], q, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(caches[2], caches[0], atol=2e-6, rtol=2e-6)
    assert torch.equal(caches[3], caches[1])  # values are copied as they are


def test_auto_picks_the_layer_kernels_on_the_cpu_in_float32_only():
    assert choose_layer_kernels("auto", CPU, torch.float32) == "cpu"
    assert choose_layer_kernels("auto", CPU, torch.float32, "int8") == "cpu"
    assert choose_layer_kernels("auto", CPU, torch.bfloat16) == "torch"
    assert choose_layer_kernels("torch", CPU, torch.float32) == "torch"
    assert choose_layer_kernels("auto", torch.device("cuda"), torch.bfloat16) is None
    with pytest.raises(ValueError, match="layer_backend cpu: the C kernels run float32, not torch.float16"):
        choose_layer_kernels("cpu", CPU, torch.float16)
    with pytest.raises(ValueError, match="layer_backend cpu: the C kernels run on the CPU, not on cuda"):
        choose_layer_kernels("cpu", torch.device("cuda"), torch.float32)


def test_int8_with_the_c_kernels_needs_the_int8_kernel_too(monkeypatch, caplog):
    def unavailable(extra_flags=()):
        raise KernelUnavailable("the int8 kernel needs AVX2")

    monkeypatch.setattr(cpu_int8_kernel, "load", unavailable)
    with caplog.at_level(logging.WARNING):
        assert choose_layer_kernels("auto", CPU, torch.float32, "int8") == "torch"
    assert "(the int8 kernel needs AVX2): the layers use oneDNN and torch" in caplog.text
    assert choose_layer_kernels("auto", CPU, torch.float32, "fp8") == "cpu"
    with pytest.raises(ValueError, match="layer_backend cpu: the int8 kernel needs AVX2"):
        choose_layer_kernels("cpu", CPU, torch.float32, "int8")


@pytest.mark.parametrize("vnni, build_max, expected", [
    (True, 127, "cpu"), (True, 63, None), (False, 63, "cpu"), (False, None, "onednn")])
def test_int8_products_go_to_the_fastest_kernel_this_cpu_has(monkeypatch, vnni, build_max, expected):
    """The C kernel where its build sums 8 bits with VNNI, or where the CPU has no VNNI for _int_mm (its AVX2
    build); _int_mm where the CPU has VNNI and the build does not (AVX-VNNI without AVX-512); without either,
    oneDNN's uint8 x int8 product (layer_backend torch)."""
    monkeypatch.setattr("glm_engine.quantization.cpu_has_int8_dot_product", lambda: vnni)
    monkeypatch.setattr(cpu_int8_kernel, "load", lambda extra_flags=(): cpu_int8_kernel.Int8Kernel(
        None, None, 32 if build_max == 127 else 16, build_max, 8))
    assert int8_cpu_kernel("cpu" if build_max else "torch") == expected
    assert int8_cpu_kernel("torch") == (None if vnni else "onednn")


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a C compiler and with an empty kernel cache."""
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv(c_kernels.CACHE_ENV, str(tmp_path))
    kernels = (cpu_decode_kernel, cpu_prefill_kernel, cpu_linear_kernel, cpu_elementwise_kernel, cpu_int8_kernel)
    for kernel in kernels:
        kernel.load.cache_clear()
    yield
    for kernel in kernels:
        kernel.load.cache_clear()


def test_without_a_compiler_auto_falls_back_and_says_why(no_compiler, caplog):
    with caplog.at_level(logging.WARNING):
        assert choose_decode_kernel("auto", CPU, torch.float32) == "torch"
        assert choose_layer_kernels("auto", CPU, torch.float32) == "torch"
    assert "attention uses the torch path" in caplog.text and "the layers use oneDNN and torch" in caplog.text
    assert "no C compiler: 'no-such-compiler' is not on PATH" in caplog.text
    with pytest.raises(ValueError, match="attention_backend cpu: no C compiler"):
        choose_decode_kernel("cpu", CPU, torch.float32)
    with pytest.raises(ValueError, match="layer_backend cpu: no C compiler"):
        choose_layer_kernels("cpu", CPU, torch.float32)


def test_an_unwritable_cache_is_named(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(c_kernels.CACHE_ENV, str(blocker / "kernels"))
    with pytest.raises(KernelUnavailable, match=f"no writable cache directory.*{c_kernels.CACHE_ENV}"):
        c_kernels.build(cpu_decode_kernel.SOURCE)


def test_a_compiler_error_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # on PATH, always fails
    monkeypatch.setenv(c_kernels.CACHE_ENV, str(tmp_path))
    with pytest.raises(KernelUnavailable, match="false failed \\(exit status 1\\)"):
        c_kernels.build(cpu_linear_kernel.SOURCE)
    assert list(tmp_path.iterdir()) == []  # no half-written kernel left for the next process


def test_the_kernel_flags_setting_reaches_every_build(monkeypatch, tmp_path):
    """GLM_KERNEL_FLAGS is passed to the compiler (a flag it rejects fails the build, naming the flag) and is part
    of the cache key (the same source with other flags is another kernel)."""
    monkeypatch.setenv(c_kernels.CACHE_ENV, str(tmp_path))
    plain = c_kernels.build(cpu_int8_kernel.SOURCE)
    monkeypatch.setenv(c_kernels.FLAGS_ENV, "-mno-avx512f")
    assert c_kernels.build(cpu_int8_kernel.SOURCE) != plain
    monkeypatch.setenv(c_kernels.FLAGS_ENV, "-fno-such-flag")
    with pytest.raises(KernelUnavailable, match="-fno-such-flag"):
        c_kernels.build(cpu_int8_kernel.SOURCE)


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


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_engine_matches_transformers_with_either_layer_backend(tiny_model, backend):
    from support.reference import GREEDY, assert_matches_reference, prompts, run_all

    model_dir, model = tiny_model
    engine = LLMEngine(EngineConfig(model_dir=model_dir, block_size=8, num_kv_blocks=64, layer_backend=backend,
                                    max_num_batched_tokens=24))
    modules = list(engine.runner.model.modules())
    assert {m.kernel for m in modules if isinstance(m, Linear)} == {"cpu" if backend == "cpu" else "onednn"}
    assert {m.c_kernel for m in modules if isinstance(m, (RMSNorm, MLP))} == {backend == "cpu"}
    requests = {f"m{i}": p for i, p in enumerate(prompts((3, 17, 9, 30), seed=13))}
    assert_matches_reference(model, requests, run_all(engine, requests), max_tokens=GREEDY.max_tokens)
