"""The benchmark scripts still run: on tiny sizes, so that a change to the engine cannot leave them broken."""

from __future__ import annotations

import json

import bench_engine
import bench_sampler


def test_bench_sampler_times_current_and_baseline_side_by_side(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    # HEAD, which every clone has (shallow ones too), read from git as any other commit is.
    assert bench_sampler.main(["--vocab", "300", "--batch", "1,3", "--repeat", "1", "--baseline", "HEAD",
                               "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    # Every setting with both logit shapes, except greedy's flat one, at both batch sizes.
    assert len(results) == 2 * (2 * len(bench_sampler.SETTINGS) - 1)
    assert all(row["ms"] > 0 and row["baseline_ms"] > 0 for row in results)
    assert "speed-up" in capsys.readouterr().out


def test_bench_engine_offline_counts_every_requested_token_greedy_and_sampled(demo_model_dir):
    requests = bench_engine.workload(3, vocab=8192)
    for sampling in (None, bench_engine.GLM4_SAMPLING):
        result = bench_engine.bench_engine_offline(demo_model_dir, requests, sampling)
        assert result["output_tokens"] == sum(length for _, length in requests)
        assert 0 <= result["kv_waste_at_peak"] < 1
