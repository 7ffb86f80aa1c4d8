"""The bls model under many concurrent clients, through the real server: its stubs used to die within the minute
(Triton 2.51's stub freed BLS responses without the GIL: triton_glm/bls_calls.py says how that is avoided)."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import requests
from support.server import crashes_since, kernel_log, running_server, stub_threads

CLIENTS = 16
SECONDS = 30
# Every output that glm can add, so that each answer frees as many BLS response tensors as it can.
EVERY_OUTPUT = {"max_tokens": 4, "return_log_probs": True, "return_perf_metrics": True,
                "return_kv_cache_reuse_stats": True}


@pytest.mark.integration
def test_bls_answers_every_request_of_many_concurrent_clients_and_its_stubs_live(demo_model_dir, tmp_path):
    """16 clients, each sending its next request as soon as it has its answer, for 30 s. Before the fix both bls
    stubs died within 30 s in every run (about 2,700 answers, then "Stub process 'bls_0_0' is not healthy", and
    once glm got an input whose name was garbled)."""
    with running_server(demo_model_dir, str(tmp_path)) as server:
        log_before, threads = kernel_log(), stub_threads(server)
        url = f"http://{server.http_url}/v2/models/bls/generate"
        outcomes: collections.Counter = collections.Counter()
        ends = time.monotonic() + SECONDS

        def client(number: int) -> None:
            sent = 0
            while time.monotonic() < ends:
                sent += 1
                prompt = f"client {number}, request {sent}: " + "tell me more " * (sent % 7)
                try:
                    answer = requests.post(url, json={"text_input": prompt, **EVERY_OUTPUT}, timeout=60)
                    outcomes["ok" if answer.status_code == 200 else f"{answer.status_code} {answer.text[:200]}"] += 1
                except requests.RequestException as exc:
                    outcomes[type(exc).__name__] += 1

        clients = [threading.Thread(target=client, args=(number,)) for number in range(CLIENTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        last = requests.post(url, json={"text_input": "still there?", "max_tokens": 2}, timeout=60)
        print(f"\n[bls under load] {CLIENTS} clients, {SECONDS} s: {dict(outcomes)}")
        assert last.status_code == 200, last.text
        assert set(outcomes) == {"ok"} and outcomes["ok"] > 10 * CLIENTS, dict(outcomes)
        if log_before is not None:
            crashes = crashes_since(log_before, threads)
            assert not crashes, crashes
