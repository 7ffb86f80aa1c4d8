"""glm_tools/gpu_check.py (scripts/gpu_check.py), the check a GPU machine runs, in its --smoke form: tiny shapes on
the CPU, the kernel under Triton's interpreter. It shows that the check runs end to end and writes what the docs say
it writes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from glm_tools import gpu_check  # noqa: E402


def test_the_smoke_run_checks_the_kernel_and_measures_every_batch(tmp_path):
    path = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--smoke", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["kernel"] and all(check["ok"] for check in results["kernel"])
    assert results["bandwidth_bytes_per_s"] > 0
    # bf16 (float32 here), int8 and fp8 weights, each at every batch size
    assert [(row["quantization"], row["batch"]) for row in results["decode"]] == [
        (quantization, batch) for quantization in ("none", "int8", "fp8") for batch in (1, 2)]
    for row in results["decode"]:
        assert row["tokens_per_s"] > 0 and row["bandwidth_limit_tokens_per_s"] > 0 and row["vs_bf16"] > 0
        assert row["step_ms_cuda_graph"] is None  # CUDA graphs are timed on CUDA only
        assert row["graph_ok"]  # but their padded, fixed-buffer steps are checked here too
    engine = results["engine"]
    assert engine["tokens_equal"] and engine["eager_output_tokens_per_s"] > 0
    assert not engine["cuda_graphs_graphs_recorded"]  # nothing is recorded on the CPU
    # Greedy and GLM-4's default sampling, peaked and flat logits, at each batch size.
    assert len(results["sampler"]) == 2 * 2 * 2 and all(row["ms"] > 0 for row in results["sampler"])
    two_versions = results["two_versions"]  # on the CPU: one engine starts, one too big for the memory is refused
    assert two_versions["ok"] and two_versions["engines_started"] == 1 and "is free" in two_versions["refusal"]
    parallel = results["tensor_parallel"]  # on the CPU: 1 and 2 ranks over gloo
    assert parallel["ok"] and [row["ranks"] for row in parallel["runs"]] == [1, 2]
    assert all(row["tokens_equal"] and row["output_tokens_per_s"] > 0 for row in parallel["runs"])


def test_the_glm4_9b_shape_is_the_published_one():
    config = gpu_check.ModelConfig.from_dict(gpu_check.GLM4_9B)
    with gpu_check.torch.device("meta"):
        model = gpu_check.GlmForCausalLM(config)
    assert 9.3e9 < sum(p.numel() for p in model.parameters()) < 9.5e9
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.rotary_dim) == (32, 2, 128, 64)


def test_a_wrong_kernel_fails_the_check(tmp_path, monkeypatch):
    import glm_engine.paged_decode_kernel as paged_decode_kernel

    monkeypatch.setattr(paged_decode_kernel, "paged_decode_attention", lambda q, *args: gpu_check.torch.zeros_like(q))
    assert gpu_check.main(["--smoke", "--json", str(tmp_path / "gpu_check.json")]) == 1


def test_wrong_graph_replays_fail_the_check(tmp_path, monkeypatch):
    from glm_engine.cuda_graph import DecodeGraphs

    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, *args: run(self, *args) * 1.1)
    assert gpu_check.main(["--smoke", "--json", str(tmp_path / "gpu_check.json")]) == 1
