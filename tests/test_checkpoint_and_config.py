"""Loading checkpoints (single-file and sharded) and the errors for what cannot be served."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from glm_engine import CheckpointError, EngineConfig, LLMEngine, ModelConfig, SamplingParams


def copy_checkpoint(source, target):
    shutil.copytree(source, target)
    return str(target)


def test_sharded_checkpoint_loads_and_matches(tiny_model, tmp_path):
    model_dir, model = tiny_model
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=8, stop_token_ids=())
    single = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=16)).generate([prompt], params)
    assert LLMEngine(EngineConfig(model_dir=sharded, num_kv_blocks=16)).generate([prompt], params) == single


@pytest.mark.parametrize("kernel", ["cpu", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_layer_packed_for_a_cpu_kernel_computes_the_same(bias, kernel):
    """On the CPU, Linear weights are packed for the C kernel or oneDNN (glm_model.Linear); CUDA keeps nn.Linear's."""
    import torch

    from glm_engine.glm_model import Linear, can_pack_for_cpu

    if kernel == "onednn" and not can_pack_for_cpu(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    layer = Linear(24, 40, bias=bias)
    x = torch.randn(7, 24)
    expected = [layer(x[:1]), layer(x)]
    layer.pack_for_cpu(kernel)
    assert layer.weight is None and layer.packed_weight is not None
    for got, want in zip([layer(x[:1]), layer(x)], expected):
        torch.testing.assert_close(got, want)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelConfig.from_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_checkpoint(str(tmp_path))


def test_unknown_architecture(tiny_model, tmp_path):
    target = copy_checkpoint(tiny_model[0], tmp_path / "llama")
    config = json.load(open(os.path.join(target, "config.json")))
    config["model_type"], config["architectures"] = "llama", ["LlamaForCausalLM"]
    json.dump(config, open(os.path.join(target, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'.*LlamaForCausalLM"):
        LLMEngine(EngineConfig(model_dir=target))


def test_missing_weights_and_missing_tensors(tiny_model, tmp_path):
    target = copy_checkpoint(tiny_model[0], tmp_path / "noweights")
    os.remove(os.path.join(target, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLMEngine(EngineConfig(model_dir=target, num_kv_blocks=4))

    from safetensors.torch import load_file, save_file
    target = copy_checkpoint(tiny_model[0], tmp_path / "partial")
    weights = load_file(os.path.join(target, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, os.path.join(target, "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing .*model.layers.1.mlp.down_proj.weight"):
        LLMEngine(EngineConfig(model_dir=target, num_kv_blocks=4))


def test_engine_parameters_from_strings():
    config = EngineConfig.from_parameters({"block_size": "32", "gpu_memory_utilization": "0.5", "device": "cpu"})
    assert (config.block_size, config.gpu_memory_utilization, config.device) == (32, 0.5, "cpu")
    with pytest.raises(ValueError, match="unknown engine parameter 'blok_size'"):
        EngineConfig.from_parameters({"blok_size": "16"})
    with pytest.raises(ValueError, match="'max_num_seqs' must be int, got 'many'"):
        EngineConfig.from_parameters({"max_num_seqs": "many"})
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig.from_parameters({"block_size": "12"})
    with pytest.raises(ValueError, match="inter_token_latency_metric must be per_token or per_request, got 'each'"):
        EngineConfig.from_parameters({"inter_token_latency_metric": "each"})
    for nice in ("-1", "20"):
        with pytest.raises(ValueError, match=rf"response_thread_nice must lie in \[0, 19\], got {nice}"):
            EngineConfig.from_parameters({"response_thread_nice": nice})


def test_rotary_settings_at_the_top_level_are_read():
    """transformers 4.x checkpoints (GLM-4-9B-chat-hf) keep rope_theta / partial_rotary_factor at the top."""
    raw = {"model_type": "glm4", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4, "rope_theta": 500.0,
           "partial_rotary_factor": 0.5, "eos_token_id": [1, 2]}
    config = ModelConfig.from_dict(raw)
    assert (config.rope_theta, config.rotary_dim, config.eos_token_ids) == (500.0, 2, (1, 2))


def test_every_engine_parameter_is_in_config_pbtxt_with_its_default_and_in_the_docs():
    import dataclasses
    import re

    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "model_repository", "glm", "config.pbtxt")) as f:
        pbtxt = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', f.read()))
    with open(os.path.join(root, "docs", "configuration.md")) as f:
        configuration = f.read().split("\n## Engine parameters\n")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", configuration, re.M))
    defaults = EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        assert field.name in pbtxt, f"{field.name} is missing from glm's config.pbtxt"
        assert field.name in documented, f"{field.name} is missing from docs/configuration.md's parameter table"
        if field.name != "model_dir":  # the only one the repository sets: the demo checkpoint
            parsed = EngineConfig.from_parameters({field.name: pbtxt[field.name]})
            assert getattr(parsed, field.name) == getattr(defaults, field.name), field.name
