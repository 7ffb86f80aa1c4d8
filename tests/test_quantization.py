"""Quantization: the 8-bit layers against their float reference, the engine with int8 / fp8 against float32, and
FP8 checkpoints in the formats of GLM's official FP8 releases (docs/quantization.md)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.checkpoints import make_tiny_checkpoint
from support.kernels import int8_kernel_or_skip
from support.reference import make_engine, prompts, record_logits, run_all

from glm_engine import CheckpointError, EngineConfig, LLMEngine, SamplingParams, cpu_int8_kernel
from glm_engine.model_runner import describe_int8_path
from glm_engine.quantization import (FP8_DTYPE, FP8_MAX, INT7_MAX, INT8_MAX, QuantizedLinear, dequantize_fp8,
                                     fp8_matmul, int8_matmul, int8_matmul_avx2, pack_int8_for_avx2, quantize_rows,
                                     int8_cpu_kernel, quantize_weight, requantize, resolve_method)

METHODS = ("int8", "fp8")


def random_layer(rows: int, in_features: int, out_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    x[0] *= 50  # an outlier token: per-token scales keep it from costing the others precision
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    return x, weight


@pytest.mark.parametrize("method", METHODS)
def test_rows_quantize_within_half_a_step(method):
    x, _ = random_layer(16, 256, 1)
    values, scales = quantize_rows(x, method)
    assert values.dtype == (torch.int8 if method == "int8" else FP8_DTYPE) and scales.shape == (16, 1)
    top = INT8_MAX if method == "int8" else FP8_MAX
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((16,), top))  # each row uses its whole range
    error = (values.float() * scales - x).abs()
    if method == "int8":  # rounding to the nearest integer step
        assert (error <= scales / 2 * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value (normal numbers), 2^-10 below 2^-6
        assert (error <= torch.maximum(x.abs() * 2 ** -4, 2 ** -10 * scales) * (1 + 1e-6)).all()
    zero_values, zero_scales = quantize_rows(torch.zeros(2, 8), method)
    assert not zero_values.float().any() and (zero_scales > 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_quantized_matmul_error_stays_within_its_bound(method):
    """|y - y_float| per element is at most what the two roundings can add up to: sum_k |x_k| dw_k + |w_k| dx_k +
    dx_k dw_k, with each rounding error at most half a step."""
    x, weight = random_layer(16, 512, 384)
    w_values, w_scales = quantize_weight(weight, method)
    x_values, x_scales = quantize_rows(x, method)
    dw = (w_values.float() * w_scales[:, None] - weight).abs()
    dx = (x_values.float() * x_scales - x).abs()
    bound = x.abs() @ dw.t() + dx @ weight.abs().t() + dx @ dw.t()
    matmul = int8_matmul if method == "int8" else fp8_matmul
    error = (matmul(x, w_values, w_scales) - x @ weight.t()).abs()
    assert (error <= bound * (1 + 1e-4) + 1e-5).all()
    # and small against the outputs: int8 keeps about 7 bits per value, e4m3 about 4 (3 stored mantissa bits)
    relative = (error.mean() / (x @ weight.t()).abs().mean()).item()
    assert relative < {"int8": 0.02, "fp8": 0.06}[method], relative


def test_int8_rows_do_not_depend_on_the_batch():
    """Per-token scales and an exact integer product: a token's result is the same bits alone or in any batch."""
    x, weight = random_layer(24, 256, 128)
    values, scales = quantize_weight(weight, "int8")
    batched = int8_matmul(x, values, scales)
    for row in (0, 5, 23):
        assert torch.equal(int8_matmul(x[row:row + 1], values, scales), batched[row:row + 1])


def avx2_matmul(x, values, scales):
    return int8_matmul_avx2(x, pack_int8_for_avx2(values), scales, torch.zeros(values.shape[0], dtype=torch.long))


def test_the_avx2_path_sums_7_bit_activations_exactly_and_per_token():
    """On CPUs without VNNI: oneDNN's uint8 x int8 product of 7-bit activations is the exact integer product (no
    16-bit saturation, outliers included), scaled per channel and per token; within 3% of float on average (int8's
    8-bit activations: 2%); a token's result is the same bits alone or in any batch."""
    x, weight = random_layer(24, 512, 384)
    w_values, w_scales = quantize_weight(weight, "int8")
    x_values, x_scales = quantize_rows(x, "int8", INT7_MAX)
    assert x_values.abs().max() == INT7_MAX
    exact = (x_values.double() @ w_values.double().t()) * w_scales.double() * x_scales.double()
    got = avx2_matmul(x, w_values, w_scales)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    reference = x @ weight.t()
    assert ((got - reference).abs().mean() / reference.abs().mean()).item() < 0.03
    for row in (0, 5, 23):
        assert torch.equal(avx2_matmul(x[row:row + 1], w_values, w_scales), got[row:row + 1])


@pytest.mark.parametrize("vnni, layer_kernels", [(True, "cpu"), (True, "torch"), (False, "cpu"), (False, "torch")])
def test_an_int8_layer_takes_the_path_this_cpu_runs_fast(monkeypatch, vnni, layer_kernels):
    """As quantization.int8_cpu_kernel says: with the C kernels, cpu_int8_kernel (the weight requantized to its
    build's range); with the torch layers, torch._int_mm with VNNI, else (where _int_mm ran 25x slower than
    float32) oneDNN's AVX2 path. The layer gives what that kernel gives."""
    monkeypatch.setattr("glm_engine.quantization.cpu_has_int8_dot_product", lambda: vnni)
    x, weight = random_layer(8, 256, 64)
    layer = QuantizedLinear(256, 64, bias=True, method="int8")
    layer.weight, layer.weight_scale = values, scales = quantize_weight(weight, "int8")
    layer.bias = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    if layer_kernels == "cpu":
        int8_kernel_or_skip()
    layer.pack_for_cpu(layer_kernels)
    assert layer.kernel == int8_cpu_kernel(layer_kernels)
    assert (layer.packed_weight is None) == (layer.kernel is None) and (layer.weight is None) != (layer.kernel is None)
    if layer.kernel is None:
        expected = int8_matmul(x, values, scales)
    elif layer.kernel == "onednn":
        expected = avx2_matmul(x, values, scales)
    else:
        values, scales = requantize(values, scales, cpu_int8_kernel.load().value_max)
        expected = cpu_int8_kernel.linear(x, *cpu_int8_kernel.pack_weight(values), scales, None)
    # the C kernel adds the bias itself (in one fused multiply-add with the scaling: up to a rounding apart)
    torch.testing.assert_close(layer(x), expected + layer.bias, rtol=1e-6, atol=1e-5)


def test_requantizing_to_7_bits_costs_at_most_a_7_bit_step():
    """Each weight moves by at most half a 7-bit step plus half an 8-bit one from the float weight: one rounding
    more than 7 bits made from the floats, within the range the AVX2 kernel takes."""
    _, weight = random_layer(1, 512, 256)
    values, scales = quantize_weight(weight, "int8")
    values7, scales7 = requantize(values, scales, 63)
    assert values7.abs().max() == 63 and values7.dtype == torch.int8
    torch.testing.assert_close(scales7, scales * 127 / 63)
    error = (values7.float() * scales7[:, None] - weight).abs()
    assert (error <= (scales7 / 2 + scales / 2)[:, None] * (1 + 1e-6)).all()


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_fp8_emulation_gives_what_scaled_mm_gives():
    """The CPU's emulation (8-bit values widened to float32) and torch's FP8 matmul on the same values both give
    their exact product (in float64) up to float32's rounding of the sums: within 2e-6 of the sum of the products'
    magnitudes (oneDNN's order of summing, with AMX or without, is not the emulation's, so not bit for bit)."""
    x, weight = random_layer(16, 256, 128)
    w_values, w_scales = quantize_weight(weight, "fp8")
    x_values, x_scales = quantize_rows(x, "fp8")
    try:
        native = torch._scaled_mm(x_values, w_values.t(), scale_a=x_scales, scale_b=w_scales[None, :],
                                  out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"_scaled_mm does not run here: {error}")
    scales = x_scales.double() * w_scales.double()
    exact = (x_values.double() @ w_values.double().t()) * scales
    magnitude = (x_values.double().abs() @ w_values.double().abs().t()) * scales
    for product in (fp8_matmul(x, w_values, w_scales), native):
        assert ((product.double() - exact).abs() <= 2e-6 * magnitude).all()


def test_quantized_linear_adds_its_bias_in_the_input_dtype():
    layer = QuantizedLinear(8, 4, bias=True, method="int8")
    values, scales = quantize_weight(torch.eye(4, 8), "int8")
    layer.weight, layer.weight_scale = values, scales
    layer.bias = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)
    out = layer(torch.eye(8)[:4] * 3)
    torch.testing.assert_close(out, torch.eye(4) * 3 + torch.arange(4.0), rtol=0, atol=1e-6)
    assert out.dtype == torch.float32


def test_fp8_scales_per_tensor_channel_and_block_dequantize():
    values = torch.randn(5, 6).clamp(-4, 4).to(FP8_DTYPE)
    wide = values.float()
    torch.testing.assert_close(dequantize_fp8(values, torch.tensor(2.0), None), wide * 2)
    per_channel = torch.arange(1.0, 6.0)
    torch.testing.assert_close(dequantize_fp8(values, per_channel[:, None], None), wide * per_channel[:, None])
    blocks = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # blocks of 4 x 2: rows 0-3 and 4, columns in pairs
    expected = wide * torch.tensor([[1.0] * 2 + [2.0] * 2 + [3.0] * 2] * 4 + [[4.0] * 2 + [5.0] * 2 + [6.0] * 2])
    torch.testing.assert_close(dequantize_fp8(values, blocks, (4, 2)), expected)
    with pytest.raises(ValueError, match="neither per tensor nor per output channel"):
        dequantize_fp8(values, torch.ones(3), None)


def test_auto_keeps_fp8_only_where_the_device_runs_it():
    cpu = torch.device("cpu")
    assert resolve_method("auto", "fp8", cpu) == "none" and resolve_method("auto", "none", cpu) == "none"
    assert resolve_method("int8", "fp8", cpu) == "int8" and resolve_method("fp8", "none", cpu) == "fp8"
    with pytest.raises(ValueError, match="quantization must be auto, none, int8, fp8"):
        EngineConfig.from_parameters({"quantization": "int4"})


def agreement_with_float(model_dir: str, method: str, layer_backend: str = "auto", **quantized_options):
    """Run the same greedy requests in float32 and quantized (with quantized_options: more engine parameters);
    compare logits step by step while the two have generated the same tokens. Returns (largest relative logit error
    |d| / |float logits| of a step, steps compared, steps whose float top-2 margin exceeds twice that step's largest
    logit error, whether all of those agreed, and the quantized engine). Twice: a flip needs the errors of the two
    top logits to close the margin."""
    requests = {f"p{i}": p for i, p in enumerate(prompts((5, 17, 9, 30), seed=7))}
    runs = {}
    for quantization in ("none", method):
        options = quantized_options if quantization != "none" else {}
        engine = make_engine(model_dir, quantization=quantization, layer_backend=layer_backend, **options)
        records = record_logits(engine)
        runs[quantization] = (run_all(engine, requests), records, engine)
    worst, compared, decisive, agreed = 0.0, 0, 0, True
    for request_id in requests:
        float_tokens, quantized_tokens = runs["none"][0][request_id], runs[method][0][request_id]
        for step, (f_logits, q_logits) in enumerate(zip(runs["none"][1][request_id], runs[method][1][request_id])):
            difference = f_logits - q_logits
            worst, compared = max(worst, (difference.norm() / f_logits.norm()).item()), compared + 1
            top2 = f_logits.topk(2).values
            if top2[0] - top2[1] > 2 * difference.abs().max():
                decisive += 1
                agreed &= float_tokens[step] == quantized_tokens[step]
            if float_tokens[step] != quantized_tokens[step]:
                break  # from here on the two decode different texts
    return worst, compared, decisive, agreed, runs[method][2]


def logit_error_bound(engine: LLMEngine, method: str) -> float:
    """The largest relative logit error a step may have with `method` on the int8 path this engine takes. Measured
    worst steps: int8 5% (7-bit activations through oneDNN 7-8%, 7-bit weights and activations through the C
    kernel's AVX2 build 7.5-13%), fp8 (3 mantissa bits) 16-18%, over 29-73 steps of which 5-43 were decided by a
    clear margin, with the LM head in float or in 8 bits alike. The trained demo model's perplexity is the measure
    of quality (docs/quantization.md)."""
    if method == "fp8":
        return 0.25
    kernel = int8_cpu_kernel(engine.runner.layer_kernels)
    if kernel == "cpu" and cpu_int8_kernel.load().value_max < 127:
        return 0.18
    return 0.12 if kernel == "onednn" else 0.08


@pytest.fixture(scope="module", params=["glm", "glm4"])
def gentler_tiny_model(request, tmp_path_factory):
    """A tiny checkpoint at initializer_range 0.1: at the usual 0.25 a random model is so sensitive that every error
    compounds (int8 18% off after 30 steps); at 0.02 its logits are too flat for greedy margins to mean anything."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param, initializer_range=0.1)[0]


@pytest.mark.parametrize("method, vnni, layer_backend", [
    ("int8", True, "cpu"), ("int8", True, "torch"), ("int8", False, "cpu"), ("int8", False, "torch"),
    ("fp8", True, "auto")],
    ids=["int8-c-kernel", "int8-torch", "int8-without-vnni-c-kernel", "int8-without-vnni-torch", "fp8"])
def test_engine_quantized_against_float32(gentler_tiny_model, method, vnni, layer_backend, monkeypatch):
    """Logits within a stated distance of float32's; greedy tokens identical wherever float32's margin says no
    error of that size could flip them. int8 on every CPU path (quantization.int8_cpu_kernel) this CPU can take."""
    if layer_backend == "cpu":
        int8_kernel_or_skip()
    monkeypatch.setattr("glm_engine.quantization.cpu_has_int8_dot_product", lambda: vnni)
    worst, compared, decisive, agreed, engine = agreement_with_float(gentler_tiny_model, method, layer_backend)
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.method == method
    kernel = int8_cpu_kernel(engine.runner.layer_kernels) if method == "int8" else None
    assert layer.self_attn.qkv_proj.kernel == kernel
    assert not isinstance(engine.runner.model.lm_head, QuantizedLinear)  # the LM head stays in float by default
    assert worst < logit_error_bound(engine, method), worst
    assert compared >= 30 and decisive >= 5 and agreed
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-embeddings"])
def test_quantize_lm_head_puts_the_head_in_8_bits_too(tmp_path, method, tied):
    """quantize_lm_head: the LM head becomes a QuantizedLinear of the projections' method (with tied embeddings an
    8-bit copy of the shared weight, the embedding left in float), the memory check counts it in 8 bits, and the
    logits stay within a stated distance of float32's, greedy tokens identical where float32's margin is clear."""
    model_dir = make_tiny_checkpoint(str(tmp_path), "glm4", initializer_range=0.1, tie_word_embeddings=tied)[0]
    worst, compared, decisive, agreed, engine = agreement_with_float(model_dir, method, quantize_lm_head=True)
    model = engine.runner.model
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.method == method
    assert "lm_head.weight" in engine.runner.quantized_weight_names
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert worst < logit_error_bound(engine, method), worst
    assert compared >= 25 and decisive >= 5 and agreed  # fp8 with its own head: 29 steps before the answers part


def test_quantize_lm_head_needs_8_bit_projections(tiny_model):
    with pytest.raises(ValueError, match="quantize_lm_head needs the projections in 8 bits.*served in float32"):
        make_engine(tiny_model[0], quantization="none", quantize_lm_head=True)


@pytest.mark.parametrize("parameters", [{"quantization": "int8"}, {"quantization": "int8", "quantize_lm_head": "true"}],
                         ids=["int8", "int8-lm-head"])
def test_int8_through_the_real_server_answers_as_the_engine_does(demo_model_dir, tmp_path, parameters):
    """quantization int8 (and quantize_lm_head) in glm's config.pbtxt: the server's greedy tokens are the offline
    engine's with the same parameters (the same kernels in the Triton stub's process), and its log names the int8
    path this CPU takes."""
    from glm_engine.tokenizer import GlmTokenizer
    from support.server import glm_answer, running_server

    prompts = ["def main():", "天气 and weather", "import os\n\nclass "]
    engine = LLMEngine(EngineConfig.from_parameters({"model_dir": demo_model_dir, "num_kv_blocks": "128",
                                                     **parameters}))
    assert isinstance(engine.runner.model.lm_head, QuantizedLinear) == ("quantize_lm_head" in parameters)
    tokenizer = GlmTokenizer(demo_model_dir)
    expected = engine.generate([tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=24))
    with running_server(demo_model_dir, str(tmp_path), parameters) as server:
        for prompt, output in zip(prompts, expected):
            answer = glm_answer(server, demo_model_dir, prompt, 24).as_numpy("output_ids").reshape(-1).tolist()
            assert answer == output, prompt
    with open(tmp_path / "tritonserver.log") as f:
        assert f"int8 products on this CPU: {describe_int8_path(engine.runner.layer_kernels)}" in f.read()


def write_fp8_checkpoint(source: str, target: str, fmt: str, block: tuple[int, int] = (16, 16)) -> dict:
    """A copy of `source` whose projection weights are FP8 in one of GLM's release formats; returns the float
    weights those FP8 tensors stand for (what the engine must load)."""
    shutil.copytree(source, target)
    weights = load_file(os.path.join(source, "model.safetensors"))
    stored, expected = {}, {}
    for name, tensor in weights.items():
        projection = name.endswith("_proj.weight")
        if not projection:
            stored[name] = expected[name] = tensor
            continue
        if fmt == "compressed-tensors":  # per output channel, weight_scale [out, 1]
            values, scales = quantize_weight(tensor, "fp8")
            stored[name], stored[name[:-len(".weight")] + ".weight_scale"] = values, scales[:, None]
            stored[name[:-len(".weight")] + ".input_scale"] = torch.ones(1)  # a static scale, which is not used
        else:  # block-wise, weight_scale_inv [ceil(out / 16), ceil(in / 16)]
            rows, columns = tensor.shape
            padded = torch.zeros(-(-rows // block[0]) * block[0], -(-columns // block[1]) * block[1])
            padded[:rows, :columns] = tensor
            tiles = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
            scales = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
            values = (tiles / scales[:, None, :, None]).view_as(padded)[:rows, :columns].to(FP8_DTYPE)
            stored[name], stored[name[:-len(".weight")] + ".weight_scale_inv"] = values, scales
        expected[name] = dequantize_fp8(stored[name], stored.get(name[:-len(".weight")] + ".weight_scale",
                                        stored.get(name[:-len(".weight")] + ".weight_scale_inv")),
                                        None if fmt == "compressed-tensors" else block)
    save_file(stored, os.path.join(target, "model.safetensors"))
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    if fmt == "compressed-tensors":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"]}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    return expected


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8-block"])
def test_fp8_checkpoints_load_as_the_weights_they_stand_for(tiny_model, tmp_path, fmt):
    """An FP8 checkpoint gives exactly what a float checkpoint of its dequantized weights gives, served in float or
    as fp8 (quantized again per channel at load)."""
    model_dir, _ = tiny_model
    fp8_dir = str(tmp_path / "fp8")
    expected = write_fp8_checkpoint(model_dir, fp8_dir, fmt)
    float_dir = str(tmp_path / "dequantized")
    shutil.copytree(model_dir, float_dir)
    save_file(expected, os.path.join(float_dir, "model.safetensors"))
    requests = {f"p{i}": p for i, p in enumerate(prompts((6, 19), seed=3))}
    for quantization in ("none", "fp8"):
        results = []
        for directory in (fp8_dir, float_dir):
            engine = make_engine(directory, quantization=quantization)
            records = record_logits(engine)
            results.append((run_all(engine, requests), {k: torch.stack(v) for k, v in records.items()}))
        (fp8_tokens, fp8_logits), (float_tokens, float_logits) = results
        assert fp8_tokens == float_tokens
        for request_id in requests:
            assert torch.equal(fp8_logits[request_id], float_logits[request_id]), (fmt, quantization)
    # on the CPU, "auto" serves an FP8 checkpoint in float
    assert make_engine(fp8_dir).runner.quantization == "none"


def test_fp8_checkpoint_formats_that_cannot_be_read_are_named(tiny_model, tmp_path):
    model_dir, _ = tiny_model
    fp8_dir = str(tmp_path / "fp8")
    write_fp8_checkpoint(model_dir, fp8_dir, "compressed-tensors")
    config_path = os.path.join(fp8_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    cases = [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({**config["quantization_config"], "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "4-bit int weights"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2' is not supported"),
        ({}, "stored in FP8 without its scale"),
    ]
    for quantization_config, message in cases:
        with open(config_path, "w") as f:
            json.dump({**config, "quantization_config": quantization_config}, f)
        with pytest.raises(CheckpointError, match=message):
            LLMEngine(EngineConfig(model_dir=fp8_dir, num_kv_blocks=4))


@pytest.mark.parametrize("method", METHODS)
def test_quantized_weights_take_a_byte_each(tiny_model, method):
    """The memory check counts what the engine holds: a byte per projection weight and a float32 scale per row."""
    from glm_engine.config import ModelConfig
    from glm_engine.glm_model import GlmForCausalLM
    from glm_engine.memory import weight_bytes

    model_dir, model = tiny_model
    with torch.device("meta"):
        names = GlmForCausalLM(ModelConfig.from_checkpoint(model_dir), method).quantized_weight_names()
    projections = {n: p for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    assert names == set(projections)
    float_bytes = sum(p.numel() * 4 for p in model.state_dict().values())
    assert weight_bytes(model_dir, torch.float32, names) == float_bytes - sum(
        3 * p.numel() - 4 * p.shape[0] for p in projections.values())
    engine = make_engine(model_dir, quantization=method)
    layer = engine.runner.model.model.layers[1]
    for projection in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        weight = projection.weight if projection.packed_weight is None else projection.packed_weight  # without VNNI
        assert weight.element_size() == 1 and projection.weight_scale.dtype == torch.float32


@pytest.mark.parametrize("parameters", [{"quantization": "int8"},
                                        {"quantization": "fp8", "quantize_lm_head": "true"}],
                         ids=["int8", "fp8-lm-head"])
def test_a_versions_probe_is_computed_with_its_quantization(demo_model_dir, parameters):
    """glm_versions.py deploy --set quantization=int8 (or fp8 with quantize_lm_head=true, whose probe answer on the
    demo model differs from fp8's alone) checks the new version against that engine's own greedy answer; the
    version's other parameters are left out (passed on, this max_num_seqs would be refused)."""
    from glm_engine import SamplingParams
    from glm_engine.tokenizer import GlmTokenizer
    from glm_tools.versions import PROBE_PROMPT, PROBE_TOKENS, VersionError, probe_for

    probe, _ = probe_for(demo_model_dir, {**parameters, "max_num_seqs": "0"})
    engine = LLMEngine(EngineConfig.from_parameters({"model_dir": demo_model_dir, "num_kv_blocks": "16",
                                                     **parameters}))
    prompt = GlmTokenizer(demo_model_dir).encode(PROBE_PROMPT)
    assert probe["token_ids"] == engine.generate([prompt], SamplingParams(max_tokens=PROBE_TOKENS))[0]
    with pytest.raises(VersionError, match="quantization must be auto, none, int8, fp8"):
        probe_for(demo_model_dir, {"quantization": "int4"})
