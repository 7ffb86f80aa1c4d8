"""glm_tools/supervisor.py's rule for a dead model process, against a stand-in server whose stub processes change
from one poll to the next (the real server's crash is tests/test_recovery.py's)."""

from __future__ import annotations

import threading

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

    def repository(self, path="index", body=None):
        return [{"name": name, "state": state} for name, state in self.current[1].items()]


def verdict(polls) -> str | None:
    stop = threading.Event()
    supervisor = Supervisor(lambda: None, poll_s=0.001)
    return supervisor._serve(FakeServer(polls, stop), stop, on_ready=lambda seconds: None)


GLM, BLS0, BLS1 = (10, ("glm", "glm_0_0")), (11, ("bls", "bls_0_0")), (12, ("bls", "bls_0_1"))
READY = {"glm": "READY", "bls": "READY"}


def test_a_reload_starts_the_new_process_first_and_is_no_crash():
    new_glm = (20, ("glm", "glm_0_0"))
    assert verdict([([GLM, BLS0], READY), ([GLM, new_glm, BLS0], READY), ([new_glm, BLS0], READY),
                    ([new_glm, BLS0], READY)]) is None


def test_one_dead_instance_of_a_model_with_two_is_a_crash():
    reason = verdict([([GLM, BLS0, BLS1], READY), ([GLM, BLS0], READY), ([GLM, BLS0], READY)])
    assert reason == "the process of model instance bls_0_1 (pid 12) died while its model was loaded"


def test_an_unloaded_model_is_no_crash():
    assert verdict([([GLM, BLS0], READY), ([BLS0], {"glm": "UNAVAILABLE", "bls": "READY"}),
                    ([BLS0], {"glm": "UNAVAILABLE", "bls": "READY"})]) is None
