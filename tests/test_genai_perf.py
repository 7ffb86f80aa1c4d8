"""genai-perf 0.0.16, unchanged (with perf_analyzer from the tritonclient 2.51 wheel, as scripts/setup_genai_perf.sh
installs them), against each way in: the ensemble, vllm_model, bls and the OpenAI front, through
scripts/genai_perf_table.py, which docs/clients.md's table comes from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from support import REPO
from support.server import OPENAI_API_KEY

GENAI_VENV = os.path.join(REPO, ".venv-genai")


def genai_environment() -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH as `source .venv-genai/env` sets them."""
    env = dict(os.environ)
    with open(os.path.join(GENAI_VENV, "env")) as f:
        for line in f:
            name, _, value = line.removeprefix("export ").strip().partition("=")
            value = value.strip('"').replace("$PATH", env.get("PATH", ""))
            value = value.replace("${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}",
                                  ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
            env[name] = value
    return env


@pytest.mark.skipif(not os.path.exists(os.path.join(GENAI_VENV, "env")),
                    reason="scripts/setup_genai_perf.sh has not run (scripts/test.sh runs it)")
def test_genai_perf_measures_every_way_in(triton_server, openai_front, demo_model_dir, tmp_path):
    out = tmp_path / "genai-perf"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "genai_perf_table.py"), "--tokenizer", demo_model_dir,
         "--grpc-url", triton_server.grpc_url, "--openai-url", openai_front.removeprefix("http://"),
         "--concurrency", "2", "--request-count", "6", "--isl", "32", "--osl", "8", "--out", str(out),
         "--openai-api-key", OPENAI_API_KEY],
        capture_output=True, text=True, timeout=600, env=genai_environment())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
    results = json.loads((out / "summary.json").read_text())["results"]
    assert set(results) == {"ensemble", "vllm_model", "bls", "openai chat"}
    for name, figures in results.items():
        if figures["attempts"] > 1:  # the first attempt's whole output is kept: say where
            warnings.warn(f"genai-perf needed {figures['attempts']} runs on {name}: {done.stderr[-3000:]}")
        assert figures["request_count"]["avg"] == 6 and figures["request_throughput"]["avg"] > 0, name
        if name != "bls":  # the streaming ways: time to first token, and between tokens
            assert 0 < figures["time_to_first_token"]["p50"] < figures["request_latency"]["p50"], name
    assert "| openai chat |" in (out / "table.md").read_text()
