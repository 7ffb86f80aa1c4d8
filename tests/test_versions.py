"""Numbered versions of glm on the real server (docs/versions.md): a deploy, a 20% canary, a promote and a rollback
while 16 clients stream through the ensemble and bls over HTTP and gRPC, with no failed request; deploys that
cannot fit or whose checkpoint is broken leave the serving version as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import requests
import tritonclient.grpc as grpcclient
from support import REPO
from support.server import abandon_a_stream, glm_inputs, metrics, running_server, wait_for

from clients.versions import VersionError, VersionManager
from glm_tools.client_load import ClientLoad
from glm_tools.demo_model import build_demo_model
from triton_glm.versions import read_traffic

pytestmark = pytest.mark.integration

# The canary's share of the requests that started and ended inside the canary phase must lie this close to 20%:
# with at least MIN_CANARY_REQUESTS of them, about four standard deviations of a fair 20% draw.
CANARY_PERCENT = 20
CANARY_TOLERANCE = 10.0
MIN_CANARY_REQUESTS = 250
# After the promote, the server's processes (tritonserver and its stubs) hold at most this much more memory than
# before the deploy: the old version's process is gone, and its memory with it.
MEMORY_MARGIN = 0.25


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    """A server of its own, on a copy of the model repository (the versions change it)."""
    with running_server(demo_model_dir, str(tmp_path_factory.mktemp("versions")), engine_parameters={}) as server:
        yield server


@pytest.fixture(scope="module")
def second_checkpoint(demo_model_dir, tmp_path_factory) -> str:
    """Another version of the demo model: its tokenizer, other weights (so another greedy answer)."""
    return build_demo_model(str(tmp_path_factory.mktemp("glm-demo-v2")), seed=1, tokenizer_from=demo_model_dir)


def manager(server, lines: list[str]) -> VersionManager:
    return VersionManager(server.http_url, server.model_repository, admin_key=server.admin_key,
                          metrics_url=f"localhost:{server.metrics_port}", out=lines.append)


def glm_stub_pids(server) -> dict[int, str]:
    """glm's stub processes -> their version."""
    return {pid: stub.version for pid, stub in server.stub_processes().items() if stub.model == "glm"}


def test_deploy_canary_promote_and_rollback_under_load_fail_no_request(server, second_checkpoint):
    lines: list[str] = []
    versions = manager(server, lines)
    timeline = {}
    memory_before = server.resident_mb()
    with ClientLoad(server.http_url, server.grpc_url) as load:
        assert wait_for(lambda: load.count() >= 16, timeout=60)
        timeline["deploy"] = time.monotonic()
        versions.deploy(2, second_checkpoint)
        with pytest.raises(VersionError, match="promote it or roll it back first"):  # one candidate at a time
            versions.deploy(3, second_checkpoint)
        abandon_a_stream(server, max_tokens=64)  # on version 1: it used to keep the version from ever unloading
        timeline["canary"] = time.monotonic()
        versions.canary(2, CANARY_PERCENT)
        canary_start = time.monotonic()
        assert wait_for(lambda: len(load.finished_between(canary_start, time.monotonic())) >= MIN_CANARY_REQUESTS,
                        timeout=240, interval=1.0)
        timeline["promote"] = time.monotonic()
        versions.promote(2)
        timeline["promoted"] = time.monotonic()
        assert versions.loaded_versions()[1] == "UNAVAILABLE"
        assert requests.get(f"http://{server.http_url}/v2/models/glm/versions/1/ready", timeout=10).status_code != 200
        memory_after_promote = server.resident_mb()
        assert set(glm_stub_pids(server).values()) == {"2"}
        time.sleep(3)
        timeline["rollback"] = time.monotonic()
        versions.rollback()
        timeline["rolled back"] = time.monotonic()
        time.sleep(3)
    end = time.monotonic()
    print("\n" + "\n".join(lines))
    results = load.results
    failed = load.failed()
    by_version = {v: sum(r.version == v for r in results) for v in (1, 2)}
    print(f"[versions] {len(results)} requests, {len(failed)} failed, by version {by_version}; timeline (s from the "
          f"deploy): " + ", ".join(f"{k} {t - timeline['deploy']:.1f}" for k, t in timeline.items()))
    assert not failed, failed[:5]
    assert all(r.version in (1, 2) for r in results)
    assert {r.client for r in results} == {kind[0] for kind in ClientLoad.KINDS}

    canary = load.finished_between(canary_start, timeline["promote"])
    share = 100.0 * sum(r.version == 2 for r in canary) / len(canary)
    print(f"[versions] canary phase: {len(canary)} requests, {share:.1f}% on version 2")
    assert abs(share - CANARY_PERCENT) <= CANARY_TOLERANCE, share
    assert {r.client for r in canary if r.version == 2} == {kind[0] for kind in ClientLoad.KINDS}  # every front follows
    assert all(r.version == 1 for r in load.finished_between(0, timeline["canary"]))
    assert all(r.version == 2 for r in load.finished_between(timeline["promoted"], timeline["rollback"]))
    after_rollback = load.finished_between(timeline["rolled back"], end)
    assert after_rollback and all(r.version == 1 for r in after_rollback)

    print(f"[versions] memory: {memory_before:.0f} MiB before the deploy, {memory_after_promote:.0f} MiB after the "
          "promote")
    assert memory_after_promote <= memory_before * (1 + MEMORY_MARGIN)
    assert set(glm_stub_pids(server).values()) == {"1"}
    assert read_traffic(os.path.join(server.model_repository, "glm")).stable == 1


def test_a_deploy_that_cannot_fit_or_is_broken_leaves_the_serving_version_untouched(server, second_checkpoint,
                                                                                      tmp_path):
    lines: list[str] = []
    versions = manager(server, lines)
    stubs_before = glm_stub_pids(server)
    traffic_before = read_traffic(os.path.join(server.model_repository, "glm"))

    with open("/proc/meminfo") as f:
        available_mb = next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable"))
    with pytest.raises(VersionError, match=r"needs .* GiB .* and .* GiB is free"):
        versions.deploy(3, second_checkpoint, {"kv_cache_memory_mb": str(available_mb + 1024)})

    broken = str(tmp_path / "broken")
    shutil.copytree(second_checkpoint, broken)
    with open(os.path.join(broken, "probe.json"), "w") as f:  # so that the tool does not run it itself
        json.dump({"prompt": "hello", "token_ids": [1, 2, 3]}, f)
    with open(os.path.join(broken, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(VersionError, match="version 4"):
        versions.deploy(4, broken)

    wrong_answer = str(tmp_path / "wrong-answer")
    shutil.copytree(second_checkpoint, wrong_answer)
    with open(os.path.join(wrong_answer, "probe.json"), "w") as f:
        json.dump({"prompt": "hello", "token_ids": [1, 2, 3]}, f)
    with pytest.raises(VersionError, match="not the checkpoint's greedy answer"):
        versions.deploy(5, wrong_answer)

    other_tokenizer = str(tmp_path / "other-tokenizer")
    build_demo_model(other_tokenizer, seed=2, vocab_size=4096)
    with pytest.raises(VersionError, match="another tokenizer.json"):
        versions.deploy(6, other_tokenizer)

    print("\n" + "\n".join(lines))
    assert glm_stub_pids(server) == stubs_before  # the same processes: never reloaded
    assert read_traffic(os.path.join(server.model_repository, "glm")) == traffic_before
    assert not any(os.path.exists(os.path.join(server.model_repository, "glm", str(v))) for v in (3, 4, 5, 6))
    loaded = versions.loaded_versions()
    assert all(loaded.get(v, "UNAVAILABLE") == "UNAVAILABLE" for v in (3, 4, 5, 6)), loaded
    answer = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate",
                           json={"text_input": "still here", "max_tokens": 4}, timeout=60)
    stable = traffic_before.stable if traffic_before else 1
    assert answer.status_code == 200 and answer.json()["glm_version"] == stable


def test_the_command_line_prints_the_status_and_exits_1_with_the_reason(server):
    command = [sys.executable, os.path.join(REPO, "scripts", "glm_versions.py"), "--url", server.http_url,
               "--metrics-url", f"localhost:{server.metrics_port}", "--model-repository", server.model_repository]
    env = {**os.environ, "GLM_ADMIN_KEY": server.admin_key}
    status = subprocess.run([*command, "status"], capture_output=True, text=True, env=env, timeout=120)
    assert status.returncode == 0, status.stderr
    header, *rows = status.stdout.splitlines()
    assert header.split()[:3] == ["version", "state", "share"] and any("READY" in row for row in rows)
    refused = subprocess.run([*command, "canary", "9", "--percent", "10"], capture_output=True, text=True, env=env,
                             timeout=120)
    assert refused.returncode == 1 and "glm_versions canary: version 9 is not loaded" in refused.stderr
    wrong_key = subprocess.run([*command, "--admin-key", "guess", "status"], capture_output=True, text=True,
                               env=env, timeout=120)
    assert wrong_key.returncode == 1 and "control-plane key" in wrong_key.stderr and "Traceback" not in wrong_key.stderr


def test_the_tool_needs_the_key_and_refuses_what_makes_no_sense(server):
    lines: list[str] = []
    with pytest.raises(VersionError, match="control-plane key"):
        VersionManager(server.http_url, server.model_repository, admin_key="guess", out=lines.append).status()
    versions = manager(server, lines)
    stable = versions.traffic().stable
    with pytest.raises(VersionError, match="is the stable version"):
        versions.canary(stable, 10)
    with pytest.raises(VersionError, match="not loaded"):
        versions.canary(9, 10)
    with pytest.raises(VersionError, match="not loaded"):
        versions.promote(9)
    with pytest.raises(VersionError, match="loaded already"):
        versions.deploy(stable, "/nonexistent")
    with pytest.raises(VersionError, match="no checkpoint folder"):
        versions.deploy(7, "/nonexistent")


def version_sample(server, name: str, version: int, **labels) -> float:
    """One glm metric of one version, e.g. glm_num_requests_running of version 1."""
    wanted = [f'version="{version}"', 'model="glm"', *(f'{k}="{v}"' for k, v in labels.items())]
    (value,) = [v for key, v in metrics(server).items() if key.split("{")[0] == name and all(w in key for w in wanted)]
    return value


def glm_stream(server, demo_model_dir, text: str, request_output_len: int, num_return_sequences: int = 1,
               enable_empty_final_response: bool = False):
    """A gRPC stream of one glm request (streaming, ignore_eos); returns the client and its (result, error) list."""
    inputs = glm_inputs(demo_model_dir, text, request_output_len, streaming=True, ignore_eos=True,
                        num_return_sequences=num_return_sequences)
    responses = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    client.async_stream_infer("glm", inputs, enable_empty_final_response=enable_empty_final_response)
    return client, responses


def test_a_forwarded_stream_whose_client_cancels_stops_where_it_runs_and_lets_its_version_unload(
        server, second_checkpoint, demo_model_dir):
    lines: list[str] = []
    versions = manager(server, lines)
    versions.deploy(2, second_checkpoint)  # the newest: Triton gives it every request, the split sends them to 1
    try:
        cancelled_before = version_sample(server, "glm_requests_finished_total", 1, finish_reason="cancelled")
        # near the demo model's 4,096 positions: 1,000 tokens had been written before the cancel came
        client, responses = glm_stream(server, demo_model_dir, "a long answer", request_output_len=4000)
        assert wait_for(lambda: len(responses) >= 2, timeout=60)
        assert all(error is None and result.as_numpy("glm_version").item() == 1 for result, error in responses)
        assert version_sample(server, "glm_num_requests_running", 1) == 1
        client.stop_stream(cancel_requests=True)
        client.close()
        assert wait_for(lambda: version_sample(server, "glm_requests_finished_total", 1, finish_reason="cancelled")
                        == cancelled_before + 1, timeout=30)
        assert version_sample(server, "glm_kv_blocks_used", 1) == 0
    finally:
        versions.rollback()  # unloads version 2, which waits for every request it forwarded to be closed
    assert versions.loaded_versions()[2] == "UNAVAILABLE"


def test_a_forwarded_request_gets_every_answer_of_num_return_sequences_then_one_final_flag(
        server, second_checkpoint, demo_model_dir):
    """The forwarded stream ends with the callee's last answer, not its first: each answer has its own finish_reason,
    and Triton's final flag goes with the last of them, as on the version that generates them."""
    versions = manager(server, [])
    versions.deploy(2, second_checkpoint)  # the newest: Triton gives it every request, the split sends them to 1
    try:
        client, responses = glm_stream(server, demo_model_dir, "two answers", request_output_len=6,
                                       num_return_sequences=2, enable_empty_final_response=True)
        assert wait_for(lambda: any(result is not None and result.get_response().parameters[
            "triton_final_response"].bool_param for result, _ in responses), timeout=60)
        time.sleep(0.5)  # nothing may follow the final flag
        client.stop_stream()
        client.close()
        assert all(error is None for _, error in responses), responses
        finals = [result.get_response().parameters["triton_final_response"].bool_param for result, _ in responses]
        assert finals.count(True) == 1 and finals[-1]
        answered = [result for result, _ in responses if result.as_numpy("finish_reason") is not None]
        ended = {int(result.as_numpy("sequence_index").item()): result.as_numpy("finish_reason").item()
                 for result in answered if result.as_numpy("finish_reason").item()}
        assert ended == {0: b"length", 1: b"length"}
        assert {int(result.as_numpy("glm_version").item()) for result in answered} == {1}
    finally:
        versions.rollback()
