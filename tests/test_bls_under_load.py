"""The bls model under many concurrent clients, through the real server: its stubs used to die within the minute
(Triton 2.51's stub freed BLS responses without the GIL: triton_glm/bls_calls.py says how that is avoided)."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from support.server import crashes_since, kernel_log, running_server, stub_threads

CLIENTS = 16
SECONDS = 30
# Every output that glm can add, so that each answer frees as many BLS response tensors as it can.
EVERY_OUTPUT = {"max_tokens": 4, "return_log_probs": True, "return_perf_metrics": True,
                "return_kv_cache_reuse_stats": True}


def generate(server, prompt: str) -> str:
    """One request to the generate endpoint, which asks for every output; 'ok' or what went wrong."""
    answer = requests.post(f"http://{server.http_url}/v2/models/bls/generate", timeout=60,
                           json={"text_input": prompt, **EVERY_OUTPUT})
    return "ok" if answer.status_code == 200 else f"{answer.status_code} {answer.text[:200]}"


def infer_text_only(client, prompt: str) -> str:
    """One request through tritonclient.http asking for text_output alone, so that bls makes fewer outputs than glm
    gives it; 'ok' or what went wrong."""
    inputs = [httpclient.InferInput("text_input", [1, 1], "BYTES"),
              httpclient.InferInput("max_tokens", [1, 1], "INT32"),
              httpclient.InferInput("return_log_probs", [1, 1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([[4]], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([[True]]))
    result = client.infer("bls", inputs, outputs=[httpclient.InferRequestedOutput("text_output")])
    return "ok" if result.as_numpy("text_output").size == 1 and result.as_numpy("output_log_probs") is None else \
        f"unexpected outputs: {result.get_response()}"


@pytest.mark.integration
def test_bls_answers_every_request_of_many_concurrent_clients_and_its_stubs_live(demo_model_dir, tmp_path):
    """16 clients, each sending its next request as soon as it has its answer, for 30 s: half to the generate
    endpoint (every output), half through tritonclient.http asking for text_output alone. Before the fix both bls
    stubs died within 30 s in every run (about 2,700 answers, then "Stub process 'bls_0_0' is not healthy", and
    once glm got an input whose name was garbled)."""
    with running_server(demo_model_dir, str(tmp_path)) as server:
        log_before, threads = kernel_log(), stub_threads(server)
        outcomes: collections.Counter = collections.Counter()
        ends = time.monotonic() + SECONDS

        def client(number: int) -> None:
            sdk = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
            sent = 0
            while time.monotonic() < ends:
                sent += 1
                prompt = f"client {number}, request {sent}: " + "tell me more " * (sent % 7)
                try:
                    outcomes[generate(server, prompt) if number % 2 else infer_text_only(sdk, prompt)] += 1
                except Exception as exc:  # a failure of any kind is counted, and shown
                    outcomes[f"{type(exc).__name__}: {str(exc)[:200]}"] += 1

        clients = [threading.Thread(target=client, args=(number,)) for number in range(CLIENTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        print(f"\n[bls under load] {CLIENTS} clients, {SECONDS} s: {dict(outcomes)}")
        assert generate(server, "still there?") == "ok"
        assert set(outcomes) == {"ok"} and outcomes["ok"] > 10 * CLIENTS, dict(outcomes)
        if log_before is not None:
            crashes = crashes_since(log_before, threads)
            assert not crashes, crashes
