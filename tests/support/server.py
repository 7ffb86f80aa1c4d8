"""Running a tritonserver for the tests and talking to it: its Prometheus samples, waiting on a condition."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from . import REPO
from glm_tools.launcher import (MODEL_REPOSITORY, TritonServer, free_port, live_processes, model_repository_with,
                                start_openai_front, stub_processes, wait_for_openai_front)

# The key the tests' OpenAI front wants.
OPENAI_API_KEY = "sk-test-key"


@contextlib.contextmanager
def running_server(model_dir: str, work_dir: str, engine_parameters: dict[str, str] | None = None):
    """The real tritonserver on free ports, serving model_dir, its log in work_dir; with engine_parameters (even {}),
    from a copy of the model repository in work_dir whose glm config.pbtxt has those parameters instead."""
    repository = MODEL_REPOSITORY if engine_parameters is None else model_repository_with(engine_parameters, work_dir)
    log_path = os.path.join(work_dir, "tritonserver.log")
    server = TritonServer(free_port(), free_port(), free_port(), model_dir=model_dir, log_path=log_path,
                          model_repository=repository, extra_env={"OMP_NUM_THREADS": "2"})
    server.start()
    try:
        server.wait_ready()
    except Exception:
        server.stop()
        with open(log_path) as f:
            sys.stderr.write(f.read()[-5000:])
        raise
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_openai_front(server, model_dir: str):
    """The OpenAI front in front of `server`, on a free port, wanting OPENAI_API_KEY; yields its base URL."""
    port = free_port()
    process = start_openai_front(server.grpc_url, port, model_dir=model_dir, api_key=OPENAI_API_KEY)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_openai_front(url)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def metrics(server) -> dict[str, float]:
    """The server's Prometheus samples, e.g. 'glm_kv_blocks_used{model="glm",version="1"}' -> value."""
    text = requests.get(f"http://localhost:{server.metrics_port}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def published_metric_names(server) -> set[str]:
    """The metric families in the server's /metrics after one request through the ensemble (the engine's histograms
    and counters appear once they have something to count)."""
    requests.post(f"http://{server.http_url}/v2/models/ensemble/generate",
                  json={"text_input": "which metrics", "max_tokens": 4}, timeout=60)
    text = requests.get(f"http://localhost:{server.metrics_port}/metrics", timeout=10).text
    return set(re.findall(r"^# TYPE (\S+)", text, re.M))


def metric(samples: dict[str, float], name: str, **labels) -> float:
    label_text = ",".join(f'{k}="{v}"' for k, v in {"finish_reason": labels.get("finish_reason")}.items() if v)
    matches = [value for key, value in samples.items()
               if key.split("{")[0] == name and label_text in key and 'model="glm"' in key]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def grpc_inputs(*tensors: tuple[str, np.ndarray, str]) -> list:
    """tritonclient.grpc inputs from (name, array, Triton datatype) triples, each of its array's shape."""
    inputs = []
    for name, array, datatype in tensors:
        inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def glm_inputs(demo_model_dir, prompt: str, max_tokens: int, streaming: bool, **scalars: bool | int):
    """Inputs of the glm model itself: token ids, as preprocessing would make them; `scalars`: more [1, 1] inputs,
    BOOL or INT32 by their Python type (e.g. ignore_eos=True, num_return_sequences=2)."""
    from glm_engine.tokenizer import GlmTokenizer

    ids = np.array([GlmTokenizer(demo_model_dir).encode(prompt)], dtype=np.int32)
    tensors = {"input_ids": (ids, "INT32"), "input_lengths": (np.array([[ids.shape[1]]], np.int32), "INT32"),
               "request_output_len": (np.array([[max_tokens]], np.int32), "INT32"),
               "streaming": (np.array([[streaming]]), "BOOL"), "exclude_input_in_output": (np.array([[True]]), "BOOL")}
    tensors.update({name: (np.array([[value]]), "BOOL") if isinstance(value, bool)
                    else (np.array([[value]], np.int32), "INT32") for name, value in scalars.items()})
    return grpc_inputs(*((name, array, datatype) for name, (array, datatype) in tensors.items()))


def glm_answer(server, demo_model_dir, prompt: str, max_tokens: int):
    """The glm model's own single response for `prompt` (its InferResult)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("glm", glm_inputs(demo_model_dir, prompt, max_tokens, streaming=False))
    result, error = results.get(timeout=60)
    client.stop_stream()
    assert error is None
    return result


def wait_for(condition, timeout=15.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


def abandon_a_stream(server, max_tokens: int) -> None:
    """An ensemble generate_stream whose HTTP client goes away after its first event (a raw socket, closed)."""
    body = json.dumps({"text_input": "gone", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("localhost", server.http_port), timeout=60) as connection:
        connection.sendall(b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:  # the headers may come alone, before the first event
            chunk = connection.recv(4096)
            assert chunk, received
            received += chunk


def stream(url: str, model: str = "ensemble", max_tokens: int = 4000, timeout: float = 60) -> dict:
    """One HTTP generate_stream read to its end: {"events": n, "last": last event, "error": what broke it}."""
    result = {"events": 0, "last": None, "error": None}
    try:
        with requests.post(f"http://{url}/v2/models/{model}/generate_stream", stream=True, timeout=timeout,
                           json={"text_input": "a long story", "max_tokens": max_tokens, "ignore_eos": True,
                                 "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: "):
                    result["events"] += 1
                    result["last"] = json.loads(line[6:])
    except requests.RequestException as error:
        result["error"] = repr(error)
    return result


def ready(http_port: int) -> bool:
    try:
        return requests.get(f"http://localhost:{http_port}/v2/health/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def ready_again(http_port: int, log_path) -> bool:
    """The launcher has restarted its server and the new one is ready. The launcher's line, not the health check
    alone: a health check that timed out on the old server, still busy failing its streams, reads as not ready, and
    that server goes on answering ready until the launcher sees its dead model process and kills it."""
    return "[serve] ready again" in open(log_path).read() and ready(http_port)


def kernel_log() -> list[str] | None:
    """The kernel's log lines (dmesg), or None where this user may not read them."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def stub_threads(server) -> set[int]:
    """The thread ids of a server's stub processes, now (the kernel's log names a crashing process by its thread)."""
    threads = set()
    for pid in server.stub_processes():
        with contextlib.suppress(FileNotFoundError):
            threads |= {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}
    return threads


def crashes_since(log_before: list[str], threads: set[int]) -> list[str]:
    """The kernel's reports of a segfault or general protection fault in one of `threads` made after `log_before`
    was read."""
    reports = (kernel_log() or [])[len(log_before):]
    return [line for line in reports if (found := re.search(r"\[(\d+)\]:? (segfault|general protection)", line))
            and int(found[1]) in threads]


def child_processes(parent_pid: int) -> dict[int, tuple[str, list[str]]]:
    """The live children of a process: pid -> (name, argv)."""
    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    return live_processes(lambda pid, name: parent(pid) == parent_pid)


@contextlib.contextmanager
def running_launcher(model_dir: str, log_path, *flags: str):
    """The launcher (scripts/triton_server.py, what serve.sh runs) on free ports with these extra flags, its output in
    log_path, once ready; yields (its process, its HTTP port). Afterwards SIGTERM must stop it with status 0."""
    http_port = free_port()
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "scripts", "triton_server.py"), "--http-port", str(http_port),
             "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--model-dir", model_dir,
             "--drain-grace", "2", *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        # "ready in" is printed once the launcher watches the server's model processes: a kill from then on is seen.
        assert wait_for(lambda: ready(http_port) and "[serve] ready in" in open(log_path).read(), timeout=180,
                        interval=0.5), open(log_path).read()[-3000:]
        yield launcher, http_port
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            code = launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            raise
    assert code == 0, open(log_path).read()[-3000:]


def glm_stub_of(launcher_pid: int) -> int:
    """The pid of glm's stub process in the server a launcher runs."""
    (server,) = [pid for pid, (name, _) in child_processes(launcher_pid).items() if name == "tritonserver"]
    (stub,) = [pid for pid, stub in stub_processes(server).items() if stub.model == "glm"]
    return stub
