"""Other projects' clients, unchanged (tests/public_clients/README.md says where each comes from), against the real
server: TensorRT-LLM backend's end-to-end client on the ensemble and its in-flight batcher client on glm (the
`tensorrt_llm` model's interface), and vllm_backend's sample client on vllm_model."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support import REPO
from support.server import grpc_inputs

TRTLLM_CLIENTS = os.path.join(REPO, "tests", "public_clients", "tensorrtllm_backend")
VLLM_CLIENT = os.path.join(REPO, "tests", "public_clients", "vllm_backend", "client.py")
# Runs a client as `python script` does, without the interpreter teardown in which grpc can hang (its docstring).
RUN_THEN_EXIT = os.path.join(REPO, "tests", "support", "run_then_exit.py")
FAILURE_MARKERS = ("Received an error from server", "Traceback (most recent call last)", "InferenceServerException")


def client_command(script: str, *args: str) -> list[str]:
    return [sys.executable, RUN_THEN_EXIT, script, *args]


def run_client(script: str, *args: str) -> str:
    done = subprocess.run(client_command(os.path.join(TRTLLM_CLIENTS, script), *args), capture_output=True,
                          text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # What these clients print on failure. (Not any "error": the model's own text may hold the word, as the demo
    # model's "OptionError" once did.)
    assert not any(marker in output for marker in FAILURE_MARKERS), output
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
    done = subprocess.run(client_command(os.path.join(TRTLLM_CLIENTS, "end_to_end_grpc_client.py"), "-u",
                                         triton_server.grpc_url, "-p", "x", "-o", "4", "--beam-width", "2"),
                          capture_output=True, text=True, timeout=120)
    assert "input 'beam_width' must be 1 (not supported: beam search)" in done.stdout
    batched = subprocess.run(client_command(os.path.join(TRTLLM_CLIENTS, "end_to_end_grpc_client.py"), "-u",
                                            triton_server.grpc_url, "-p", '["one", "two"]', "-o", "4",
                                            "--batch-inputs"),
                             capture_output=True, text=True, timeout=120)
    assert "one prompt per request, got 2: send each prompt as a request of its own" in batched.stdout


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


@pytest.mark.parametrize("options", [[], ["--streaming-mode", "--exclude-inputs-in-outputs"]],
                         ids=["single", "streaming"])
def test_vllm_backend_sample_client_on_vllm_model(triton_server, tmp_path, options):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n你好\n")
    results = tmp_path / "results.txt"
    done = subprocess.run(client_command(VLLM_CLIENT, "-u", triton_server.grpc_url, "--input-prompts", str(prompts),
                                         "--results-file", str(results), *options), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert "PASS: vLLM example" in done.stdout, done.stdout + done.stderr
    answers = results.read_text().split("\n=========\n")[:2]
    assert all(answer.strip() for answer in answers)
    if not options:  # vllm_backend echoes the prompt in a single response
        assert answers[0].startswith("def main():") and answers[1].strip().startswith("你好")


def vllm_request(url: str, settings: dict, stream: bool, switches=("return_finish_reason", "return_logprobs",
                 "return_cumulative_logprob", "return_num_input_tokens", "return_num_output_tokens"),
                 outputs=None) -> list:
    """One request as vllm_backend's clients make it (no batch dimension), its responses' outputs as numpy.
    `outputs`: the outputs to name (None: none, so Triton asks for all)."""
    inputs = grpc_inputs(("text_input", np.array([b"count to ten"], dtype=np.object_), "BYTES"),
                         ("stream", np.array([stream]), "BOOL"), ("exclude_input_in_output", np.array([True]), "BOOL"),
                         ("sampling_parameters", np.array([json.dumps(settings).encode()], dtype=np.object_), "BYTES"),
                         *((switch, np.array([True]), "BOOL") for switch in switches))
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("vllm_model", inputs, request_id="vllm-outputs",
                              outputs=None if outputs is None else
                              [grpcclient.InferRequestedOutput(name) for name in outputs])
    client.stop_stream()
    responses = []
    while not results.empty():
        result, error = results.get()
        assert error is None, str(error)
        responses.append({name: result.as_numpy(name) for name in ("text_output", "finish_reason",
                                                                  "cumulative_logprob", "logprobs",
                                                                  "num_input_tokens", "num_output_tokens")})
    return responses


def test_vllm_model_outputs_have_vllm_backends_shapes_and_meanings(triton_server):
    settings = {"max_tokens": "12", "temperature": "0", "ignore_eos": "true"}
    responses = vllm_request(triton_server.grpc_url, settings, stream=True)
    assert all(r["text_output"].shape == (1,) and r["num_input_tokens"].shape == (1,) for r in responses)
    assert [r["finish_reason"][0] for r in responses][-1] == b"length"
    assert all(r["finish_reason"][0] == b"None" for r in responses[:-1])  # str(None), as vllm_backend sends it
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == 12  # each response counts its own tokens
    entries = [entry for r in responses for entry in json.loads(r["logprobs"][0])]
    assert len(entries) == 12 and all(len(entry) == 1 for entry in entries)
    total = sum(next(iter(entry.values()))["logprob"] for entry in entries)
    assert abs(float(responses[-1]["cumulative_logprob"][0]) - total) < 1e-3
    whole, = vllm_request(triton_server.grpc_url, settings, stream=False)
    assert whole["text_output"][0].decode() == "".join(r["text_output"][0].decode() for r in responses)


def test_vllm_model_sends_what_its_switches_or_the_client_ask_for_and_names_bad_settings(triton_server):
    response, = vllm_request(triton_server.grpc_url, {"max_tokens": 4}, stream=False, switches=(),
                             outputs=["text_output"])  # as vllm_backend's sample client asks
    assert response["text_output"] is not None and response["finish_reason"] is None
    response, = vllm_request(triton_server.grpc_url, {"max_tokens": 4}, stream=False, switches=())
    # No outputs named: every output (perf_analyzer's way), log-probs as vllm_backend sends them when not computed.
    assert response["logprobs"][0] == b"null" and response["cumulative_logprob"][0] == 0
    assert response["num_output_tokens"][0] == 4 and response["finish_reason"][0] == b"length"
    with pytest.raises(AssertionError, match="unsupported keys"):
        vllm_request(triton_server.grpc_url, {"max_tokens": 4, "best_of_everything": 1}, stream=False)
