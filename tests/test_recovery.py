"""Crashes, stalls, shutdown and disconnects: the engine's watchdog and drain, and through the real server, a killed
model process healed by the launcher's supervisor, a drained shutdown, and streams whose clients went away."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from support.checkpoints import make_tiny_checkpoint
from support.reference import prompts
from support.server import (abandon_a_stream, crashes_since, glm_stub_of, grpc_inputs, kernel_log, metric, metrics,
                            ready, ready_again, running_launcher, running_server, stream, stub_threads, wait_for)
import tritonclient.utils.shared_memory as shared_memory
from tritonclient.utils import InferenceServerException

from glm_engine import EngineConfig, EngineThread, LLMEngine, SamplingParams, Unavailable
from glm_engine.watchdog import STALLED_EXIT_STATUS, Watchdog
from glm_tools.launcher import ADMIN_KEY_HEADER, EXIT_TIMEOUT_S, GRPC_ADMIN_KEY_HEADER, free_port

LONG = SamplingParams(max_tokens=400, stop_token_ids=())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4-recovery")), "glm4")[0]


def engine_thread(model_dir, **settings) -> EngineThread:
    return EngineThread(lambda: LLMEngine(EngineConfig(model_dir=model_dir, block_size=8, num_kv_blocks=256,
                                                       **settings)))


class Collector:
    """Outputs of one request, and when it finished."""

    def __init__(self):
        self.outputs = []
        self.done = threading.Event()

    def __call__(self, output):
        self.outputs.append(output)
        if output.finished:
            self.done.set()
        return True


# -- the engine thread and its watchdog ------------------------------------------------------------------------------
def test_drain_refuses_new_requests_and_ends_running_ones_after_the_grace_period(model_dir, tmp_path):
    thread = engine_thread(model_dir)
    original_step = thread.engine.step
    thread.engine.step = lambda: time.sleep(0.01) or original_step()  # 400 tokens take well over the grace period
    short, long = Collector(), Collector()
    thread.submit("short", prompts((6,))[0], SamplingParams(max_tokens=3, stop_token_ids=()), short)
    thread.submit("long", prompts((6,))[0], LONG, long)
    drain_file = tmp_path / "drain"
    watchdog = Watchdog(thread, stall_timeout_s=0, drain_file=str(drain_file), poll_s=0.05)
    time.sleep(0.2)
    assert not thread.draining  # no file, no drain
    drain_file.write_text("1.0")
    assert wait_for(lambda: thread.draining, timeout=2)
    with pytest.raises(Unavailable, match="shutting down"):
        thread.submit("late", prompts((6,))[0], LONG, Collector())
    assert short.done.wait(5) and short.outputs[-1].error is None  # finished within the grace period, as asked
    assert long.done.wait(10)
    last = long.outputs[-1]
    assert last.unavailable and "shutting down" in last.error and len(long.outputs) > 3
    assert thread.engine.stats().kv_blocks_used == 0
    watchdog.stop()
    thread.shutdown()


def test_shutdown_with_a_grace_period_lets_running_requests_finish_first(model_dir):
    thread = engine_thread(model_dir)
    collector = Collector()
    thread.submit("a", prompts((6,))[0], SamplingParams(max_tokens=40, stop_token_ids=()), collector)
    thread.shutdown(grace_s=30)  # what glm's finalize does when Triton unloads the model
    assert collector.done.is_set() and collector.outputs[-1].error is None
    assert sum(len(output.new_token_ids) for output in collector.outputs) == 40


def test_the_watchdog_ends_the_process_when_the_engine_thread_stalls_or_dies(model_dir):
    thread = engine_thread(model_dir)
    exits = []
    release = threading.Event()
    original_step = thread.engine.step
    thread.engine.step = lambda: release.wait(30) and original_step()  # a step that hangs until released
    watchdog = Watchdog(thread, stall_timeout_s=0.5, drain_file="", poll_s=0.05, exit_process=exits.append)
    time.sleep(0.8)
    assert exits == []  # idle is not stalled
    thread.submit("a", prompts((6,))[0], LONG, Collector())
    assert wait_for(lambda: exits, timeout=5) and exits == [STALLED_EXIT_STATUS]
    release.set()
    thread.shutdown()
    watchdog.stop()

    dead = engine_thread(model_dir)
    dead.shutdown()  # the thread has ended: as if it had died
    exits.clear()
    watchdog = Watchdog(dead, stall_timeout_s=60, drain_file="", poll_s=0.05, exit_process=exits.append)
    assert wait_for(lambda: exits, timeout=5) and exits == [STALLED_EXIT_STATUS]
    watchdog.stop()


# -- through the real server ----------------------------------------------------------------------------------------
def openai_health(port: int) -> int:
    try:
        return requests.get(f"http://localhost:{port}/health", timeout=5).status_code
    except requests.ConnectionError:
        return 0


@pytest.mark.integration
def test_a_killed_model_process_is_seen_at_once_and_healed_by_the_launcher(demo_model_dir, tmp_path):
    """...and the OpenAI front that serve.sh starts beside it answers again once the model is back."""
    openai_port = free_port()
    log_path = tmp_path / "serve.log"
    with running_launcher(demo_model_dir, log_path, "--openai-port", str(openai_port)) as (launcher, http_port):
        url = f"localhost:{http_port}"
        glm_stub = glm_stub_of(launcher.pid)

        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, url) for _ in range(4)]
            time.sleep(2)  # all four are generating
            os.kill(glm_stub, signal.SIGKILL)
            killed = time.monotonic()
            assert wait_for(lambda: not ready(http_port), timeout=10, interval=0.1), log_path.read_text()[-3000:]
            not_ready_after = time.monotonic() - killed
            results = [future.result(timeout=30) for future in streams]  # an error each, not a hang
        assert all(result["error"] for result in results), results
        assert all(result["last"] is None or result["last"]["finish_reason"] == "" for result in results), results
        assert not_ready_after < 5

        assert wait_for(lambda: ready_again(http_port, log_path), timeout=180, interval=0.5), \
            log_path.read_text()[-3000:]
        print(f"\n[recovery] not ready {not_ready_after:.2f} s after the kill, ready again after "
              f"{time.monotonic() - killed:.1f} s")
        response = requests.post(f"http://{url}/v2/models/ensemble/generate", timeout=60,
                                 json={"text_input": "after the crash", "max_tokens": 8})
        assert response.status_code == 200 and response.json()["num_output_tokens"] == 8
        assert wait_for(lambda: openai_health(openai_port) == 200, timeout=30)
        completion = requests.post(f"http://localhost:{openai_port}/v1/completions", timeout=60,
                                   json={"model": "glm", "prompt": "after the crash", "max_tokens": 4})
        assert completion.json()["usage"]["completion_tokens"] == 4
        assert f"glm_0_0 of glm version 1 (pid {glm_stub}) died while it was loaded: restarting" in log_path.read_text()


LONG_STREAM_TOKENS = 30_000


def with_long_context(model_dir: str, directory: str) -> str:
    """A copy of the demo checkpoint with room for 32,768 positions (a random model: rotary takes any position), for
    streams that are still running whenever a test stops the server. Its 4,096 were too few: the C kernels wrote
    ~4,000 tokens a stream before the drain below began."""
    shutil.copytree(model_dir, directory)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "max_position_embeddings": 32_768}, f)
    return directory


@pytest.mark.integration
def test_shutdown_drains_streams_runs_finalize_and_leaves_no_shared_memory(demo_model_dir, tmp_path):
    model_dir = with_long_context(demo_model_dir, str(tmp_path / "long-context"))
    with running_server(model_dir, str(tmp_path)) as server:
        server.drain_grace_s = 5.0

        def running() -> float:
            return metric(metrics(server), "glm_num_requests_running")

        with ThreadPoolExecutor(5) as pool:
            long_streams = [pool.submit(stream, server.http_url, max_tokens=LONG_STREAM_TOKENS) for _ in range(3)]
            assert wait_for(lambda: running() == 3, timeout=30)
            short_stream = pool.submit(stream, server.http_url, max_tokens=40)
            assert wait_for(lambda: running() == 4 or short_stream.done(), timeout=30)
            regions = server.shm_regions()
            log_before, threads = kernel_log(), stub_threads(server)
            stop_began = time.monotonic()
            stopping = pool.submit(server.stop)
            assert wait_for(lambda: os.path.exists(server.drain_file), timeout=5)
            time.sleep(1)
            late = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", timeout=30,
                                 json={"text_input": "too late", "max_tokens": 8})
            started = time.monotonic()
            stopping.result(timeout=60)
            stopped_in = time.monotonic() - started
            print(f"\n[recovery] stop() took {time.monotonic() - stop_began:.1f} s with a {server.drain_grace_s:g} s "
                  "drain grace")
            results = [future.result(timeout=30) for future in long_streams]
            short = short_stream.result(timeout=30)
    # Triton's generate endpoint answers it with 400 or 503 (docs/requests.md); the message says what happened.
    assert late.status_code in (400, 503) and "shutting down" in late.json()["error"], late.text
    assert short["last"]["finish_reason"] == "length" and short["error"] is None, short
    for result in results:  # each stream ended with an error event naming the shutdown, not a cut connection
        assert result["error"] is None and result["events"] > 1, result
        assert "shutting down" in json.dumps(result["last"]), result
    # The grace, the unloads (2-4 s here) and a second for SIGTERM: on a busy 2-core machine, well within the grace plus
    # Triton's default exit timeout of 30 s, which the stop used to wait out before killing the stubs.
    assert stopped_in < server.drain_grace_s + 20, stopped_in
    log_text = (tmp_path / "tritonserver.log").read_text()
    assert "glm engine stopped" in log_text and "Exit timeout expired" not in log_text, log_text[-3000:]
    assert regions and not any(os.path.exists(region) for region in regions)
    # Every stub exited cleanly: glm's used to segfault on its way out, its metrics deleted after its shared memory.
    if log_before is not None:
        crashes = crashes_since(log_before, threads)
        assert not crashes, crashes


@pytest.mark.integration
def test_streams_whose_clients_went_away_end_at_max_tokens_and_sigterm_stays_prompt(demo_model_dir, tmp_path):
    """Triton 2.51 tells no model that a client went away (an HTTP connection closed, a gRPC stream cancelled): each
    stream generates to its max_tokens, the bound docs/operations.md gives, and its blocks come back. The ensemble
    then ends those requests (it used to keep them "in flight" for ever, which kept glm from unloading and made
    tritonserver wait out its exit timeout on SIGTERM and kill its stubs: the ensemble's config.pbtxt says why), so
    glm unloads and a SIGTERM to tritonserver itself stops it in a few seconds."""
    with running_server(demo_model_dir, str(tmp_path)) as server:
        abandon_a_stream(server, max_tokens=120)
        responses = []
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: responses.append(error))
        client.async_stream_infer("ensemble", grpc_inputs(
            ("text_input", np.array([[b"cancelled"]], dtype=np.object_), "BYTES"),
            ("max_tokens", np.array([[120]], dtype=np.int32), "INT32"), ("ignore_eos", np.array([[True]]), "BOOL"),
            ("stream", np.array([[True]]), "BOOL")))
        assert wait_for(lambda: responses, timeout=30)
        client.stop_stream(cancel_requests=True)
        client.close()
        assert wait_for(lambda: metric(metrics(server), "glm_requests_finished_total", finish_reason="length") == 2,
                        timeout=90)
        samples = metrics(server)
        assert metric(samples, "glm_num_requests_running") == 0 and metric(samples, "glm_kv_blocks_used") == 0
        assert metric(samples, "glm_generation_tokens_total") == 240
        regions = server.shm_regions()
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)  # tritonserver alone: its own shutdown, not the launcher's
        server.process.wait(timeout=60)
        stopped_in = time.monotonic() - started
        print(f"\n[recovery] SIGTERM to exit: {stopped_in:.1f} s")
    log_text = (tmp_path / "tritonserver.log").read_text()
    assert stopped_in < EXIT_TIMEOUT_S and "Exit timeout expired" not in log_text, log_text[-3000:]
    assert log_text.count("glm engine stopped") == 1
    assert regions and not any(os.path.exists(region) for region in regions)


@pytest.mark.integration
def test_the_control_plane_needs_the_key_and_a_reload_swaps_the_model_process(demo_model_dir, tmp_path):
    with running_server(demo_model_dir, str(tmp_path)) as server:
        base = f"http://{server.http_url}"
        for method, path in (("post", "/v2/repository/index"), ("post", "/v2/repository/models/glm/unload"),
                             ("post", "/v2/systemsharedmemory/region/r/register"), ("post", "/v2/logging"),
                             ("post", "/v2/trace/setting")):
            refused = getattr(requests, method)(base + path, json={}, timeout=10)
            assert refused.status_code in (401, 403), (path, refused.status_code, refused.text)
            wrong_key = requests.post(base + path, json={}, headers={ADMIN_KEY_HEADER: "guess"}, timeout=10)
            assert wrong_key.status_code in (401, 403), (path, wrong_key.status_code)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        with pytest.raises(InferenceServerException):
            client.unload_model("glm")
        assert client.get_model_repository_index(headers={GRPC_ADMIN_KEY_HEADER: server.admin_key})
        client.close()
        assert requests.get(base + "/v2/models/glm/config", timeout=10).status_code == 200  # reading stays open
        # With the key, shared memory registers and unregisters.
        region = shared_memory.create_shared_memory_region("glm-key-test", "/glm_key_test", 64)
        try:
            key = {ADMIN_KEY_HEADER: server.admin_key}
            registered = requests.post(base + "/v2/systemsharedmemory/region/glm-key-test/register", headers=key,
                                       json={"key": "/glm_key_test", "offset": 0, "byte_size": 64}, timeout=10)
            assert registered.status_code == 200, registered.text
            status = requests.get(base + "/v2/systemsharedmemory/status", headers=key, timeout=10).json()
            assert [entry["name"] for entry in status] == ["glm-key-test"]
            assert requests.post(base + "/v2/systemsharedmemory/region/glm-key-test/unregister", headers=key,
                                 timeout=10).status_code == 200
        finally:
            shared_memory.destroy_shared_memory_region(region)
        assert {entry["name"] for entry in server.repository()} == {"bls", "ensemble", "glm", "postprocessing",
                                                                    "preprocessing", "vllm_model"}

        def glm_stubs() -> list[int]:
            return [pid for pid, stub in server.stub_processes().items() if stub.model == "glm"]

        def generated() -> float:
            return metric(metrics(server), "glm_generation_tokens_total")

        (old_stub,) = glm_stubs()
        old = requests.post(base + "/v2/models/ensemble/generate", json={"text_input": "old", "max_tokens": 4},
                            timeout=60)
        assert old.status_code == 200 and wait_for(lambda: generated() == 4)
        assert server.reload_model("glm")
        assert wait_for(lambda: len(glm_stubs()) == 1, timeout=60)
        (new_stub,) = glm_stubs()
        assert new_stub != old_stub and server.is_ready()
        answer = requests.post(base + "/v2/models/ensemble/generate", json={"text_input": "new", "max_tokens": 4},
                               timeout=60)
        assert answer.status_code == 200 and answer.json()["num_output_tokens"] == 4
        # The new process carries on with the old one's series: the old one's exit used to delete them under it
        # (and tritonserver segfaulted at the new one's next update: triton_glm/metrics.py, EngineMetrics.close).
        assert wait_for(lambda: generated() == 8)
