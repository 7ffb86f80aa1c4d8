"""Other projects' clients, unchanged (tests/public_clients/README.md says where each comes from), against the real
server: TensorRT-LLM backend's end-to-end client on the ensemble and its in-flight batcher client on glm (the
`tensorrt_llm` model's interface)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import REPO

TRTLLM_CLIENTS = os.path.join(REPO, "tests", "public_clients", "tensorrtllm_backend")


def run_client(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, os.path.join(TRTLLM_CLIENTS, script), *args], capture_output=True,
                          text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "error" not in output.lower(), output
    return output


@pytest.mark.parametrize("streaming", [[], ["--streaming"]], ids=["single", "streaming"])
def test_tensorrt_llm_end_to_end_client(triton_server, streaming):
    output = run_client("end_to_end_grpc_client.py", "-u", triton_server.grpc_url, "-p", "def main():", "-o", "12",
                        "--return-log-probs", *streaming)
    assert "output_log_probs" in output
    if not streaming:
        assert "0: def main():" in output  # the prompt and its answer, as TensorRT-LLM echoes it


def test_tensorrt_llm_end_to_end_client_with_several_answers_and_perf_metrics(triton_server):
    output = run_client("end_to_end_grpc_client.py", "-u", triton_server.grpc_url, "-p", "def main():", "-o", "12",
                        "--num-return-sequences", "3", "--temperature", "1.0", "--return-perf-metrics",
                        "--exclude-input-in-output")
    answers = [line for line in output.splitlines() if line.startswith("0 [")]
    assert sorted(line[:4] for line in answers) == ["0 [0", "0 [1", "0 [2"]
    assert len(set(answers)) == 3, answers  # three samples, not one answer thrice
    assert "kv_cache_alloc_total_blocks: 1" in output and "total_draft_tokens: 0" in output


def test_tensorrt_llm_end_to_end_client_hears_what_is_not_supported(triton_server):
    done = subprocess.run([sys.executable, os.path.join(TRTLLM_CLIENTS, "end_to_end_grpc_client.py"), "-u",
                           triton_server.grpc_url, "-p", "x", "-o", "4", "--beam-width", "2"],
                          capture_output=True, text=True, timeout=120)
    assert "input 'beam_width' must be 1 (beam search is not supported)" in done.stdout


@pytest.mark.parametrize("options", [["--streaming"], ["--num-return-sequences", "2", "--top-k", "5"],
                                     ["--streaming", "--stop-after-ms", "300", "--request-id", "to-stop",
                                      "--request-output-len", "400"]],
                         ids=["streaming", "two-answers", "stopped"])
def test_tensorrt_llm_inflight_batcher_client_on_glm(triton_server, demo_model_dir, options):
    """The in-flight batcher client speaks to the engine model directly, with token ids from the checkpoint's own
    tokenizer (transformers' AutoTokenizer); its `stop` request must end the stream early (it checks that itself)."""
    if "--request-output-len" not in options:
        options = [*options, "--request-output-len", "8"]
    output = run_client("inflight_batcher_llm_client.py", "-u", triton_server.grpc_url, "--model-name", "glm",
                        "--tokenizer-dir", demo_model_dir, "--text", "def main():", *options)
    assert "Output beam 0:" in output
    if "--num-return-sequences" in options:
        assert "Output beam 1:" in output
