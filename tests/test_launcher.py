"""glm_tools/launcher.py: what the tests, benchmarks and serve.sh start the server with."""

from __future__ import annotations

import os
import resource

import pytest

from glm_tools import launcher
from glm_tools.launcher import (ALLOCATORS, PROCESS_ONLY_ENV, SERVER_STACK_BYTES, allocator_library, server_env,
                                server_stack_limit)


def session_processes(leader: int) -> list[int]:
    """The server and the Python stub processes it started: every process of the session it leads."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        if int(fields[3]) == leader:  # the session id, the sixth field of /proc/PID/stat
            pids.append(int(entry))
    return pids


def environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_settings_of_the_starting_process_are_kept_from_the_server_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = server_env("/some/checkpoint")
    assert not set(PROCESS_ONLY_ENV) & set(env)
    assert env["GLM_MODEL_DIR"] == "/some/checkpoint" and "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]
    assert not set(PROCESS_ONLY_ENV) & set(server_env(None, bundled=False))


@pytest.mark.integration
def test_a_server_started_from_the_tests_runs_no_kernel_in_the_interpreter(triton_server):
    """The test process runs Triton-language kernels in Triton's interpreter (conftest.py); the server it starts,
    like the benchmark's (the same launcher), and the glm stub inside it must not."""
    assert os.environ["TRITON_INTERPRET"] == "1"
    pids = session_processes(triton_server.process.pid)
    assert len(pids) >= 2, pids  # the server and at least one Python stub
    for pid in pids:
        assert "TRITON_INTERPRET" not in environment(pid), pid
        assert environment(pid)["GLM_MODEL_DIR"] == os.path.abspath(triton_server.model_dir)


def test_allocators_are_found_or_refused_by_name():
    assert allocator_library("system") is None
    auto = allocator_library("auto")
    assert auto is None or auto.endswith("libjemalloc.so.2")
    for name, library in ALLOCATORS.items():
        try:
            assert allocator_library(name).endswith(library)
        except FileNotFoundError as error:
            assert "install Debian's" in str(error)


@pytest.mark.integration
def test_the_server_and_its_stubs_run_with_jemalloc_when_it_is_installed(triton_server):
    library = allocator_library("auto")
    if library is None:
        pytest.skip("libjemalloc2 is not installed here (scripts/setup_env.sh installs it where it can)")
    for pid in session_processes(triton_server.process.pid):
        with open(f"/proc/{pid}/maps") as f:
            assert library in f.read(), pid


@pytest.mark.integration
def test_the_server_listens_on_the_loopback_address_unless_told_otherwise(triton_server):
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.rsplit(":", 1)
                if state == "0A":  # LISTEN
                    listening.setdefault(int(port, 16), set()).add(address)
    for port in (triton_server.http_port, triton_server.grpc_port, triton_server.metrics_port):
        # 127.0.0.1 only, as IPv4 or IPv4-mapped IPv6 (gRPC's listener)
        assert listening.get(port) and listening[port] <= {"0100007F", "0000000000000000FFFF00000100007F"}, \
            (port, listening.get(port))


@pytest.mark.parametrize("overcommit, limits, expected", [
    ("0", (8 * 2**20, resource.RLIM_INFINITY), (SERVER_STACK_BYTES, resource.RLIM_INFINITY)),
    ("1", (resource.RLIM_INFINITY, resource.RLIM_INFINITY), (SERVER_STACK_BYTES, resource.RLIM_INFINITY)),
    ("0", (8 * 2**20, 64 * 2**20), (64 * 2**20, 64 * 2**20)),  # within the hard limit
    ("0", (2 * SERVER_STACK_BYTES, resource.RLIM_INFINITY), None),  # larger already
    ("2", (8 * 2**20, resource.RLIM_INFINITY), None),  # a strict commit limit: 240 such stacks would not fit
])
def test_the_servers_stack_limit(monkeypatch, tmp_path, overcommit, limits, expected):
    setting = tmp_path / "overcommit_memory"
    setting.write_text(overcommit + "\n")
    monkeypatch.setattr(launcher, "OVERCOMMIT_SETTING", str(setting))
    monkeypatch.setattr(launcher.resource, "getrlimit", lambda which: limits)
    assert server_stack_limit() == expected


@pytest.mark.integration
def test_the_server_and_its_stubs_run_with_the_larger_stack_limit(triton_server):
    """What lets the server take deeply nested JSON (tests/test_fuzz.py)."""
    expected = server_stack_limit()
    if expected is None:
        pytest.skip("this machine's limits are left as they are (strict overcommit, or a larger stack already)")
    for pid in session_processes(triton_server.process.pid):
        assert resource.prlimit(pid, resource.RLIMIT_STACK) == expected, pid
