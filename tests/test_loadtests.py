"""The Locust load tests: a short headless run of every user class against the real server, through the runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO
from support.server import OPENAI_API_KEY, running_openai_front, running_server

from glm_tools.demo_model import TRAINED_CHECKPOINT

from loadtests.prompts import FINAL_STATS, SYSTEM_PROMPT, RequestMix, parse_range
from loadtests.run import duration_s

pytestmark = pytest.mark.integration


def test_the_request_mix_is_seeded_and_keeps_to_its_ranges():
    first = [RequestMix(seed=3, prompt_words=(16, 64), output_tokens=(8, 32)).next() for _ in range(2)]
    assert first[0] == first[1]
    mix = RequestMix(seed=3, prompt_words=(16, 64), output_tokens=(8, 32))
    requests = [mix.next() for _ in range(200)]
    assert all(16 <= len(r.prompt.split()) <= 64 and 8 <= r.max_tokens <= 32 for r in requests)
    assert len({r.prompt for r in requests}) > 150
    shared = RequestMix(seed=1, scenario="shared-prefix").next()
    assert shared.prompt.startswith(SYSTEM_PROMPT)
    with pytest.raises(ValueError):
        parse_range("64-16")


@pytest.fixture(scope="module")
def trained_server(tmp_path_factory):
    """A server of the trained demo model, the one serve.sh serves (whose answers end on their own, and whose stop
    strings occur), with its OpenAI front: (server, front URL)."""
    with running_server(TRAINED_CHECKPOINT, str(tmp_path_factory.mktemp("trained"))) as server:
        with running_openai_front(server, TRAINED_CHECKPOINT) as url:
            yield server, url


def test_a_short_headless_run_of_every_user_class(trained_server, tmp_path):
    """Bounded by requests (24), with a run time (60 s) it must not reach; sampling as GLM-4 does. One user of each
    class, against the trained demo model."""
    triton_server, openai_front = trained_server
    out = tmp_path / "results"
    completed = subprocess.run(
        [sys.executable, os.path.join(REPO, "loadtests", "run.py"), "--host", f"http://{triton_server.http_url}",
         "--grpc-url", triton_server.grpc_url, "--openai-url", openai_front, "--openai-api-key", OPENAI_API_KEY,
         "--users", "4", "--run-time", "60s", "--max-requests", "24", "--prompt-words", "16-48",
         "--output-tokens", "8-24", "--temperature", "0.8", "--top-p", "0.8",
         "--user-class", "HttpGenerateUser", "HttpStreamUser", "GrpcStreamUser", "OpenAiChatUser",
         "--label", "smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    summary = json.loads((out / "summary.json").read_text())
    run, = summary["runs"]
    # --max-requests ended the run long before --run-time (which would have given well over 100 requests).
    assert run["users"] == 4 and run["failures"] == 0 and 4 < run["requests"] <= 24 + 4
    assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
    for key in ("latency_ms", "ttft_ms"):
        assert 0 < run[key]["p50"] <= run[key]["p95"] <= run[key]["p99"], (key, run[key])
    # Locust rounds times under 100 ms to whole milliseconds, and tokens that reach the client in one read (a busy
    # machine coalesces events) are under half of one apart: the ITL median may be 0, its tail may not.
    assert 0 <= run["itl_ms"]["p50"] <= run["itl_ms"]["p95"] <= run["itl_ms"]["p99"], run["itl_ms"]
    assert run["itl_ms"]["p99"] > 0, run["itl_ms"]
    # Each user class recorded its requests, and the streaming ones their TTFT and ITL, as separate entries.
    for name in ("generate", "generate_stream", "generate_stream TTFT", "generate_stream ITL", "grpc_stream",
                 "grpc_stream TTFT", "grpc_stream ITL", "chat_stream", "chat_stream TTFT", "chat_stream ITL"):
        assert run["entries"][name]["requests"] > 0 and run["entries"][name]["failures"] == 0, name
    for suffix in ("_stats.csv", FINAL_STATS, ".html"):
        assert (out / f"smoke-u4{suffix}").stat().st_size > 0
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_runner_reads_locusts_run_time():
    assert [duration_s(text) for text in ("90", "40s", "2m", "1h30m")] == [90, 40, 120, 5400]
    with pytest.raises(SystemExit):
        duration_s("soon")


def test_the_runner_stays_on_loopback(tmp_path):
    completed = subprocess.run([sys.executable, os.path.join(REPO, "loadtests", "run.py"), "--host",
                                "http://192.0.2.1:8000", "--out", str(tmp_path)], capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 2 and "loopback" in completed.stderr
