"""The benchmark scripts still run, as a user runs them: on tiny sizes, so that a change to the engine cannot leave
them broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    completed = subprocess.run([sys.executable, os.path.join(REPO, "scripts", name), *args], capture_output=True,
                               text=True, timeout=300, cwd=REPO)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed


def test_bench_sampler_times_current_and_baseline_side_by_side(tmp_path):
    out = tmp_path / "sampler.json"
    # HEAD, which every clone has (shallow ones too), read from git as any other commit is.
    completed = run_script("bench_sampler.py", "--vocab", "300", "--batch", "1,3", "--repeat", "1",
                           "--baseline", "HEAD", "--json", str(out))
    written = json.loads(out.read_text())
    results = written["results"]
    # Every setting with both logit shapes, except greedy's flat one, at both batch sizes.
    assert len(results) == 2 * (2 * len(written["settings"]) - 1)
    assert all(row["ms"] > 0 and row["baseline_ms"] > 0 for row in results)
    assert "speed-up" in completed.stdout


def test_bench_engine_offline_counts_every_requested_token_in_every_variant(demo_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    runs = ("engine_offline", "engine_offline_int8", "engine_offline_tp2", "engine_offline_torch_attention",
            "engine_offline_torch_layers", "engine_offline_sampled")
    run_script("bench_engine.py", "--model-dir", demo_model_dir, "--num-requests", "3", "--runs",
               ",".join(runs + ("matmul_peak",)), "--json", str(out))
    written = json.loads(out.read_text())
    (results,) = written["rounds"]
    for name in runs:
        assert results[name]["output_tokens"] == written["requested_output_tokens"]
        assert 0 <= results[name]["kv_waste_at_peak"] < 1
    assert 0 < written["summary"]["sampled_vs_greedy"]
    assert 0 < written["summary"]["engine_offline_int8"]["vs_float32"]
    assert 0 < written["summary"]["engine_offline_tp2"]["vs_one_rank"]
    assert 0 < written["summary"]["engine_offline"]["vs_torch_attention"]
    assert 0 < written["summary"]["engine_offline"]["vs_torch_layers"]
    assert written["model_flops"] > 0 and 0 < written["summary"]["engine_offline"]["of_matmul_peak"]


@pytest.mark.parametrize("client", ["asyncio", "threads"])
def test_bench_engine_through_triton_counts_every_token_with_either_client(demo_model_dir, tmp_path, client):
    out = tmp_path / "bench.json"
    runs = ["engine_through_triton"] + (["engine_through_triton_itl_per_request", "engine_through_triton_uncoalesced",
                                         "engine_through_triton_nice0"] if client == "asyncio" else [])
    run_script("bench_engine.py", "--model-dir", demo_model_dir, "--num-requests", "3", "--client", client,
               "--runs", ",".join(runs), "--json", str(out))
    written = json.loads(out.read_text())
    (results,) = written["rounds"]
    for name in runs:
        run = results[name]
        assert run["client"] == client and run["clients"] == 3
        assert run["output_tokens"] == written["requested_output_tokens"]
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] and 0 <= run["itl_p50_s"] <= run["itl_p99_s"]
        assert 0 <= run["response_gap_p50_s"] <= run["response_gap_p99_s"]
        assert run["cpu_s"]["glm"] > 0 and run["cpu_s"]["clients"] > 0 and run["cpu_s"]["server"] >= 0
        assert 3 <= run["responses"] <= run["output_tokens"]
        assert written["summary"][name]["tokens_per_response"] >= 1
    if client == "asyncio":
        assert 0 < written["summary"]["engine_through_triton_itl_per_request"]["vs_itl_per_token"]
        assert 0 < written["summary"]["engine_through_triton"]["vs_uncoalesced"]
        assert 0 < written["summary"]["engine_through_triton"]["vs_nice0"]


def test_bench_contention_runs_quiet_and_contended_and_measures_the_competitor(demo_model_dir, tmp_path):
    out = tmp_path / "contention.json"
    run_script("bench_contention.py", "--model-dir", demo_model_dir, "--num-requests", "3", "--rounds", "1",
               "--quantization", "none", "--busy-ms", "0.5", "--period-ms", "1", "--json", str(out))
    written = json.loads(out.read_text())
    (row,) = written["rounds"]
    assert row["output_tokens"] == [written["requested_output_tokens"]] * 2
    assert row["quiet_tokens_per_s"] > 0 and row["contended_tokens_per_s"] > 0
    # The competitor busy-waits half of every millisecond: it took a real share of the machine.
    assert 0.05 < row["competitor_share"] * written["cores"]


def test_bench_quantization_measures_perplexity_agreement_and_memory(tmp_path):
    out = tmp_path / "quality.json"
    run_script("bench_quantization.py", "--windows", "2", "--prompts", "3", "--max-tokens", "4",
               "--methods", "none,int8,int8+lm_head", "--json", str(out))
    results = {row["method"]: row for row in json.loads(out.read_text())["results"]}
    assert results["none"]["perplexity_vs_reference"] == 1 and results["none"]["identical"] == 1
    assert 0.9 < results["int8"]["perplexity_vs_reference"] < 1.1
    # 8-bit projections, then the LM head too: less memory each time
    assert results["none"]["weight_bytes"] > results["int8"]["weight_bytes"] > results["int8+lm_head"]["weight_bytes"]


def test_bench_linear_times_float_and_int8_layers(tmp_path):
    out = tmp_path / "linear.json"
    run_script("bench_linear.py", "--rows", "1,4", "--repeat", "1", "--json", str(out))
    written = json.loads(out.read_text())
    results = written["results"]
    assert len(results) == 4 * 2 and all(row["int8_gflops"] > 0 and row["float32_gflops"] > 0 and
                                         row["onednn_u8s8_alone_gflops"] > 0 for row in results)
    assert isinstance(written["int8_dot_product"], bool)
    if written["int8_kernel_uses_amx"]:  # the AMX and VNNI builds side by side
        assert all(row["amx_vs_without"] > 0 and row["int8_without_amx_gflops"] > 0 for row in results)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_bench_attention_times_the_c_kernel_against_the_torch_path(tmp_path, phase):
    out = tmp_path / "attention.json"
    completed = run_script("bench_attention.py", "--phase", phase, "--seqs", "3", "--pool-blocks", "256", "--layers",
                           "2", "--rounds", "2", "--calls", "2", "--json", str(out))
    written = json.loads(out.read_text())
    assert written["largest_difference"] < 1e-5
    assert all(len(written["rounds"][path]) == 2 for path in ("torch", "c_kernel"))
    assert all(written["summary"][path]["rate"] > 0 for path in ("torch", "c_kernel"))
    assert written["summary"]["rate_unit"] == ("GFLOP/s" if phase == "prefill" else "keys and values read, GB/s")
    assert written["summary"]["c_kernel_speedup"] > 0 and "x the torch path" in completed.stdout


def test_bench_output_processor_times_stop_strings_against_a_baseline(demo_model_dir, tmp_path):
    out = tmp_path / "output.json"
    run_script("bench_output_processor.py", "--model-dir", demo_model_dir, "--repeat", "1", "--baseline", "HEAD",
               "--json", str(out))
    written = json.loads(out.read_text())
    assert [row["stop_strings"] for row in written["output_processor"]] == [0, 1, 1, 8, 8, 64, 64]
    assert all(row["streaming_us"] > 0 and row["single_us"] > 0 for row in written["output_processor"])
    assert len(written["stop_string_filter"]) == 6
    assert all(row["current_us"] > 0 and row["baseline_us"] > 0 for row in written["stop_string_filter"])


def test_bench_burst_reports_served_and_refused_requests(demo_model_dir, tmp_path):
    out = tmp_path / "burst.json"
    run_script("bench_burst.py", "--model-dir", demo_model_dir, "--requests", "12", "--max-tokens", "64",
               "--max-num-seqs", "1", "--max-waiting-requests", "1", "--no-baseline", "--json", str(out))
    (summary,) = json.loads(out.read_text()).values()
    assert summary["served"]["count"] + summary["refused"]["count"] == 12 and not summary["other_errors"]
    assert summary["served"]["count"] >= 1 and summary["refused"]["count"] >= 1


def test_bench_rollout_times_every_step_of_a_rollout_under_load(tmp_path):
    out = tmp_path / "rollout.json"
    run_script("bench_rollout.py", "--clients-per-kind", "1", "--canary-seconds", "3", "--json", str(out))
    summary = json.loads(out.read_text())
    steps = {(step["command"], step["step"]) for step in summary["steps"]}
    assert {("deploy 2", "load"), ("deploy 2", "probe"), ("promote 2", "unload"), ("rollback", "unload")} <= steps
    assert summary["failed"] == 0 and summary["requests"] > 0 and summary["first_canary_answer_s"] is not None


def test_bench_rollout_measures_forwarded_against_direct_streams(tmp_path):
    out = tmp_path / "forwarding.json"
    run_script("bench_rollout.py", "--forwarding", "--rounds", "1", "--json", str(out))
    summary = json.loads(out.read_text())
    assert summary["direct"]["served_by"] == [2] and summary["forwarded"]["served_by"] == [1]
    assert all(summary[way]["streams"] == 8 and summary[way]["ttft_ms_p50"] > 0 for way in ("direct", "forwarded"))


def test_soak_samples_memory_and_engine_gauges_into_csv_json_and_a_plot(demo_model_dir, tmp_path):
    out = tmp_path / "soak"
    run_script("soak.py", "--model-dir", demo_model_dir, "--minutes", "0.2", "--interval", "3", "--users", "2",
               "--reload-every", "0.1", "--user-classes", "HttpStreamUser", "GrpcStreamUser", "--out", str(out))
    summary = json.loads((out / "soak.json").read_text())
    assert {"tritonserver", "glm", "preprocessing", "postprocessing", "bls"} <= set(summary["rss"])
    assert summary["user_classes"] == ["HttpStreamUser", "GrpcStreamUser"]
    assert summary["samples"] >= 3 and summary["tokens"] > 0
    header = (out / "soak.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["seconds", "rss_mb bls"] and "glm_kv_blocks_used" in header
    assert (out / "soak.png").stat().st_size > 10_000


def test_bench_openai_measures_the_front_against_grpc_side_by_side(tmp_path):
    out = tmp_path / "openai.json"
    run_script("bench_openai.py", "--rounds", "2", "--concurrency", "2", "--max-tokens", "8", "--json", str(out))
    summary = json.loads(out.read_text())
    for way in ("grpc", "openai"):  # ignore_eos both ways: the same tokens
        assert summary[way]["streams"] == 4 and summary[way]["output_tokens"] == 32, summary[way]
        assert 0 < summary[way]["ttft_ms_p50"] <= summary[way]["latency_ms_p50"]
    assert summary["ratios"]["tokens_per_s"] > 0


def test_bench_affinity_routes_each_session_to_one_server_and_compares_policies(demo_model_dir, tmp_path):
    import shutil

    import pytest

    if not (shutil.which("nginx") or os.path.exists("/usr/sbin/nginx")):
        pytest.skip("nginx is not installed (scripts/test.sh installs Debian's nginx-light where it can)")
    out = tmp_path / "affinity.json"
    completed = run_script("bench_affinity.py", "--model-dir", demo_model_dir, "--conversations", "2", "--turns", "3",
                           "--concurrency", "2", "--rounds", "1", "--prefix-words", "80", "--max-tokens", "2",
                           "--json", str(out))
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"round_robin", "session_hash"}
    # By session, each later turn finds the turns before it cached: about (L1 + L2) / (L1 + L2 + L3) of the tokens.
    assert summary["session_hash"]["prefix_hit_rate"] > 0.4
    assert all(figures["later_turns_p50_ms"] > 0 for figures in summary.values())
    assert "round-robin over session hash" in completed.stdout


def test_bench_compile_times_eager_against_compiled_variants(demo_model_dir, tmp_path):
    out = tmp_path / "compile.json"
    completed = run_script("bench_compile.py", "--model-dir", demo_model_dir, "--num-requests", "2", "--steps", "2",
                           "--rounds", "1", "--json", str(out))
    written = json.loads(out.read_text())
    assert set(written["median_ms"]) == {"eager", "norms", "mlp_frozen"}
    assert all(ms > 0 for ms in written["median_ms"].values())
    assert "eager / variant" in completed.stdout


def test_bench_startup_times_this_tree_against_a_commit_and_finds_torch_in_glm_alone(demo_model_dir, tmp_path):
    out = tmp_path / "startup.json"
    # HEAD, which every clone has (shallow ones too).
    run_script("bench_startup.py", "--rounds", "1", "--baseline", "HEAD", "--model-dir", demo_model_dir,
               "--json", str(out))
    written = json.loads(out.read_text())
    for row in written["rounds"] + written["baseline_rounds"]:
        assert 0 < row["ready_s"] and 0 < row["stop_s"] and row["resident_mb"] > 0
        models = {process["model"] for process in row["processes"]}
        assert {"tritonserver", "glm", "preprocessing", "postprocessing", "bls", "vllm_model"} == models
    (current,) = written["rounds"]
    assert [p["model"] for p in current["processes"] if p["torch"]] == ["glm"]
    assert written["summary"]["ready_speedup"] > 0
