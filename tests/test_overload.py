"""Overload: the engine's admission limits refuse what would wait beyond them, at once, and a request that waits too
long ends as overloaded; through the real server, a burst gets its excess refused with 503 and the rest served."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import REPO
from support.checkpoints import make_tiny_checkpoint
from support.reference import prompts
from support.server import OPENAI_API_KEY, metric, metrics, running_openai_front, running_server, wait_for
from tritonclient.utils import InferenceServerException

from clients import HttpClient, OverloadedError
from glm_engine import EngineConfig, EngineThread, FinishReason, LLMEngine, Overloaded, SamplingParams

LONG = SamplingParams(max_tokens=100, stop_token_ids=())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4-overload")), "glm4")[0]


def engine(model_dir, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, block_size=8, num_kv_blocks=128, **settings))


def test_admission_counts_waiting_requests_and_their_prompt_tokens(model_dir):
    llm = engine(model_dir, max_num_seqs=1, max_waiting_requests=2, max_waiting_tokens=40)
    for request_id, prompt in zip("ab", prompts((10, 10))):
        llm.add_request(request_id, prompt, LONG)
    llm.check_admission(10)  # a will take the free place in the batch, b waits: one more may wait
    with pytest.raises(Overloaded, match="2 requests are waiting to start \\(max_waiting_requests 2\\)"):
        llm.check_admission(10, queued_requests=1)  # one on its way counts too: it would be the third to wait
    with pytest.raises(Overloaded, match="20 prompt tokens are waiting to be computed \\(max_waiting_tokens 40\\)"):
        llm.check_admission(30)  # 20 waiting + 30 > 40
    llm.step()  # a joins the batch: b waits, the batch is full
    llm.check_admission(10)
    with pytest.raises(Overloaded):
        llm.check_admission(10, queued_requests=1)
    assert llm.stats().refused == 3


def test_a_request_refused_by_the_engine_thread_is_refused_at_once_and_costs_nothing(model_dir):
    thread = EngineThread(lambda: engine(model_dir, max_num_seqs=1, max_waiting_requests=2))
    finished = []

    def submit(request_id, seed):
        thread.submit(request_id, prompts((6,), seed=seed)[0], LONG,
                      lambda output: finished.append(output) if output.finished else None)

    try:
        submit("a", 1)
        deadline = time.monotonic() + 30
        while not thread.engine.scheduler.running and time.monotonic() < deadline:  # a runs...
            time.sleep(0.001)
        submit("b", 2)
        submit("c", 3)  # ...b and c wait
        started = time.perf_counter()
        with pytest.raises(Overloaded, match="the server is overloaded"):
            submit("d", 4)
        assert time.perf_counter() - started < 0.5  # refused without waiting for the engine
        while len(finished) < 3 and time.monotonic() < deadline + 30:
            time.sleep(0.01)
    finally:
        thread.shutdown()
    assert sorted(o.request_id for o in finished) == ["a", "b", "c"]
    assert all(o.finish_reason is FinishReason.LENGTH for o in finished)
    assert thread.engine.pool.num_free_blocks == thread.engine.pool.num_blocks


def test_a_request_that_waits_too_long_ends_as_overloaded_and_the_others_go_on(model_dir):
    llm = engine(model_dir, max_num_seqs=1, max_queue_time_s=5.0)
    alone = engine(model_dir).generate([prompts((9,))[0]], LONG)[0]
    llm.add_request("running", prompts((9,))[0], LONG)
    llm.add_request("waiting", prompts((9,), seed=4)[0], LONG)
    outputs = llm.step()  # "running" joins; "waiting" waits
    llm.sequences["waiting"].arrival_time -= 10  # as if it had waited 10 s
    outputs += llm.step()
    (expired,) = [o for o in outputs if o.request_id == "waiting"]
    assert expired.finished and expired.unavailable and "waited 10.0 s" in expired.error
    tokens = [t for o in outputs if o.request_id == "running" for t in o.new_token_ids]
    while llm.has_unfinished_requests():
        tokens += [t for o in llm.step() for t in o.new_token_ids]
    assert tokens == alone and llm.stats().refused == 1
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


# -- through the real server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(demo_model_dir, tmp_path_factory):
    """A server whose engine runs 2 sequences and lets 4 wait: small limits, so that a burst passes them."""
    parameters = {"max_num_seqs": "2", "max_waiting_requests": "4"}
    with running_server(demo_model_dir, str(tmp_path_factory.mktemp("overload")), parameters) as server:
        yield server


def bls_request(server, index: int) -> tuple[str, float, str]:
    """One bls request over HTTP (even index) or gRPC (odd): ("ok" or the error's status, seconds, message)."""
    module, url = (httpclient, server.http_url) if index % 2 == 0 else (grpcclient, server.grpc_url)
    client = module.InferenceServerClient(url)
    text = module.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[f"request {index}".encode()]], dtype=np.object_))
    limit = module.InferInput("max_tokens", [1, 1], "INT32")
    # long enough that the first requests still run when the last of a burst arrive, however fast the engine
    limit.set_data_from_numpy(np.array([[400]], dtype=np.int32))
    started = time.perf_counter()
    try:
        client.infer("bls", [text, limit])
        return "ok", time.perf_counter() - started, ""
    except InferenceServerException as error:
        return error.status(), time.perf_counter() - started, error.message()
    finally:
        client.close()


@pytest.mark.integration
def test_a_burst_gets_its_excess_refused_at_once_and_the_rest_served(small_server):
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda index: bls_request(small_server, index), range(24)))
    served = [seconds for status, seconds, _ in results if status == "ok"]
    refused = [(status, seconds, message) for status, seconds, message in results if status != "ok"]
    assert len(served) >= 2 and len(refused) >= 1 and len(served) + len(refused) == 24, results
    for status, _, message in refused:
        assert status in ("503", "StatusCode.UNAVAILABLE") and "the server is overloaded" in message, status
    # Refused without waiting for the engine: each refusal came back before most served requests did (their
    # times in docs/performance.md).
    assert max(seconds for _, seconds, _ in refused) < statistics.median(served), (refused, served)
    assert metric(metrics(small_server), "glm_requests_refused_total") == len(refused)

    # The ensemble's generate endpoint refuses too; Triton 2.51 answers that error with 400 or 503 (docs/requests.md),
    # but the message says it, and the SDK calls it OverloadedError on both models. The queue must stay full while
    # the three requests below are refused: requests a second or more long on any engine (1,000 tokens took well
    # under a second on the C kernels).
    busy_tokens = 3000

    def busy() -> int:
        try:
            return HttpClient(small_server.http_url).generate("keep busy", max_tokens=busy_tokens, ignore_eos=True) \
                .num_output_tokens
        except OverloadedError:
            return 0

    refused_before = metric(metrics(small_server), "glm_requests_refused_total")
    with ThreadPoolExecutor(12) as pool:
        filling = [pool.submit(busy) for _ in range(12)]  # 2 run, 4 wait, the rest are refused
        # Once one is refused the queue is full, and stays so until a running request ends, a second or more away.
        assert wait_for(lambda: metric(metrics(small_server), "glm_requests_refused_total") > refused_before,
                        timeout=30, interval=0.02)
        response = requests.post(f"http://{small_server.http_url}/v2/models/ensemble/generate", timeout=60,
                                 json={"text_input": "one too many", "max_tokens": 8})
        assert response.status_code in (400, 503) and "the server is overloaded" in response.json()["error"]
        for model in ("ensemble", "bls"):
            with pytest.raises(OverloadedError, match="overloaded"):
                HttpClient(small_server.http_url, model=model).generate("one too many", max_tokens=8)
        outcomes = [future.result() for future in filling]
        assert set(outcomes) == {0, busy_tokens} and outcomes.count(busy_tokens) >= 2  # some served whole, some refused
    assert small_server.is_ready() and metric(metrics(small_server), "glm_kv_blocks_used") == 0


@pytest.mark.integration
def test_the_load_tests_count_refused_requests_apart_from_failures(small_server, tmp_path):
    out = tmp_path / "results"
    completed = subprocess.run(
        [sys.executable, os.path.join(REPO, "loadtests", "run.py"), "--host", f"http://{small_server.http_url}",
         "--grpc-url", small_server.grpc_url, "--users", "16", "--run-time", "8s", "--prompt-words", "16-32",
         "--output-tokens", "64-128", "--user-class", "HttpGenerateUser", "HttpStreamUser", "GrpcStreamUser",
         "--label", "overload", "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (run,) = json.loads((out / "summary.json").read_text())["runs"]
    assert run["failures"] == 0 and run["overloaded"] > 0 and run["requests"] > 0, run
    refused = {name: entry["requests"] for name, entry in run["entries"].items() if name.endswith(" overloaded")}
    assert sum(refused.values()) == run["overloaded"], refused


@pytest.mark.integration
def test_the_openai_front_answers_overload_with_429_and_the_others_are_served(small_server, demo_model_dir):
    """OpenAI's SDKs retry a 429; with retries off, the refused ones see it, the others are answered in full. Long
    answers (1,500 tokens), so that the first ones are still running when the last arrive, however fast the engine:
    with 200 the C kernels finished them while the burst was still arriving, and nobody was refused."""
    answer_tokens = 1500
    with running_openai_front(small_server, demo_model_dir) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=OPENAI_API_KEY, max_retries=0)

        def chat(index: int):
            try:
                reply = client.chat.completions.create(
                    model="glm", messages=[{"role": "user", "content": f"request {index}"}], max_tokens=answer_tokens,
                    extra_body={"ignore_eos": True})
                return reply.usage.completion_tokens
            except openai.RateLimitError as error:
                return error

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(chat, range(16)))
    refused = [result for result in results if isinstance(result, openai.RateLimitError)]
    served = results.count(answer_tokens)
    assert refused and served >= 2 and len(refused) + served == 16, results
    for error in refused:
        assert error.status_code == 429 and error.body["code"] == "overloaded"
        assert "the server is overloaded" in error.body["message"]
    assert small_server.is_ready() and wait_for(lambda: metric(metrics(small_server), "glm_kv_blocks_used") == 0)
