"""glm_tools/supervisor.py's rule for a dead model process, against a stand-in server whose stub processes change
from one poll to the next (the real server's crash is tests/test_recovery.py's)."""

from __future__ import annotations

import threading

from glm_tools.launcher import Stub
from glm_tools.supervisor import Supervisor


class FakeProcess:
    returncode = None

    def poll(self):
        return None


class FakeServer:
    """Answers each poll with the next of `polls`: (stub processes, each model's state); sets `stop` after the last."""

    def __init__(self, polls, stop: threading.Event):
        self.polls, self.stop, self.process = list(polls), stop, FakeProcess()
        self.current = self.polls[0]

    def is_ready(self):
        return True

    def shm_regions(self):
        return set()

    def stub_processes(self):
        if len(self.polls) == 1:
            self.stop.set()
        self.current = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
        return dict(self.current[0])

    def repository(self, path="index", body=None, timeout_s=120.0):
        return [{"name": name, "version": version, "state": state}
                for (name, version), state in self.current[1].items()]


def verdict(polls, on_ready=lambda server: None) -> str | None:
    """What the supervisor makes of these polls; on_ready(the server) runs where the launcher prints "ready in"."""
    stop = threading.Event()
    server = FakeServer(polls, stop)
    return Supervisor(lambda: None, poll_s=0.001)._serve(server, stop, on_ready=lambda seconds: on_ready(server))


GLM = (10, Stub("glm", "1", "glm_0_0"))
BLS0, BLS1 = (11, Stub("bls", "1", "bls_0_0")), (12, Stub("bls", "1", "bls_0_1"))
READY = {("glm", "1"): "READY", ("bls", "1"): "READY"}


def test_a_reload_starts_the_new_process_first_and_is_no_crash():
    new_glm = (20, Stub("glm", "1", "glm_0_0"))
    assert verdict([([GLM, BLS0], READY), ([GLM, new_glm, BLS0], READY), ([new_glm, BLS0], READY),
                    ([new_glm, BLS0], READY)]) is None


def test_one_dead_instance_of_a_model_with_two_is_a_crash():
    reason = verdict([([GLM, BLS0, BLS1], READY), ([GLM, BLS0], READY), ([GLM, BLS0], READY)])
    assert reason == "the process of model instance bls_0_1 of bls version 1 (pid 12) died while it was loaded"


def test_an_unloaded_model_is_no_crash():
    unloaded = {("glm", "1"): "UNAVAILABLE", ("bls", "1"): "READY"}
    assert verdict([([GLM, BLS0], READY), ([BLS0], unloaded), ([BLS0], unloaded)]) is None


def test_during_a_rollout_each_version_is_watched_and_the_old_one_may_go():
    canary = (30, Stub("glm", "2", "glm_0_0"))
    both = {("glm", "1"): "READY", ("glm", "2"): "READY", ("bls", "1"): "READY"}
    # The canary's process dies while the stable one, with an instance of the same name, lives on: a crash.
    reason = verdict([([GLM, canary, BLS0], both), ([GLM, BLS0], both), ([GLM, BLS0], both)])
    assert reason == "the process of model instance glm_0_0 of glm version 2 (pid 30) died while it was loaded"
    # A promote unloads version 1: no crash.
    promoted = {("glm", "1"): "UNAVAILABLE", ("glm", "2"): "READY", ("bls", "1"): "READY"}
    assert verdict([([GLM, canary, BLS0], both), ([canary, BLS0], promoted), ([canary, BLS0], promoted)]) is None


def test_a_process_killed_as_soon_as_the_server_is_announced_ready_is_seen():
    """The processes are counted before "ready in" is printed: a kill after it (as the recovery tests do) is a crash,
    not a smaller count to start from."""
    def kill_glm(server):
        server.polls = [([BLS0], READY)] * len(server.polls)

    reason = verdict([([GLM, BLS0], READY), ([GLM, BLS0], READY), ([GLM, BLS0], READY)], on_ready=kill_glm)
    assert reason == "the process of model instance glm_0_0 of glm version 1 (pid 10) died while it was loaded"
