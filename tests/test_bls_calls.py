"""Decoupled BLS calls (triton_glm/bls_calls.py) against a stand-in for pb_utils' response iterator: the caller's
cancellation is asked after each response and before it is yielded, calls are taken to their end, and a request
refused as not ready is sent again. test_bls_under_load.py runs the real stub."""

from __future__ import annotations

import sys
import types

import pytest

from support import fake_pb_utils

fake_pb_utils.install(sys.modules)

from triton_glm import bls_calls  # noqa: E402
from triton_glm.bls_calls import bls_responses, exec_latest  # noqa: E402


class BlsResponse:
    """A response that a BLS call yields: an error's message, or a token."""

    def __init__(self, error: str | None = None, token: int | None = None):
        self.message, self.token = error, token

    def has_error(self):
        return self.message is not None

    def error(self):
        return types.SimpleNamespace(message=lambda: self.message)


class ResponseIterator:
    """As pb_utils' own: each iter() starts over from the first response once the last was taken. `events` records
    each response taken."""

    def __init__(self, responses, events):
        self.responses, self.index, self.events = responses, 0, events

    def __iter__(self):
        if self.index == len(self.responses):
            self.index = 0
        return self

    def __next__(self):
        if self.index == len(self.responses):
            raise StopIteration
        self.index += 1
        self.events.append(f"took {self.index}")
        return self.responses[self.index - 1]


class BlsRequest:
    """A BLS request whose n-th send yields the n-th list of responses."""

    def __init__(self, *sends):
        self.sends, self.sent, self.events, self.iterators = list(sends), 0, [], []

    def exec(self, decoupled):
        assert decoupled
        self.sent += 1
        self.iterators.append(ResponseIterator(self.sends.pop(0), self.events))
        return self.iterators[-1]


class Caller:
    """The request being answered: its is_cancelled() is recorded in the same events."""

    def __init__(self, events, cancelled=False):
        self.events, self.cancelled = events, cancelled

    def is_cancelled(self):
        self.events.append("asked")
        return self.cancelled


@pytest.fixture(autouse=True)
def nothing_kept(monkeypatch):
    monkeypatch.setattr(bls_calls, "_kept", bls_calls.collections.deque())
    monkeypatch.setattr(bls_calls, "NOT_READY_RETRIES", (0.0, 0.0, 0.0))


def kept():
    return [responses for _, responses in bls_calls._kept]


def test_the_caller_is_asked_after_each_response_arrives_and_before_it_is_yielded():
    """The round trip that makes Triton 2.51's stub let go of a finished call before Python does (the docstring of
    bls_responses): asked after the last response was taken, before the consumer can answer its caller."""
    request = BlsRequest([BlsResponse(token=1), BlsResponse(token=2)])
    caller = Caller(request.events)
    for response, cancelled in bls_responses(request, caller):
        request.events.append(f"yielded {response.token}")
        assert not cancelled
    assert request.events == ["took 1", "asked", "yielded 1", "took 2", "asked", "yielded 2"]
    assert kept() == []


def test_a_consumer_that_leaves_early_has_the_rest_taken_and_kept():
    request = BlsRequest([BlsResponse(token=1), BlsResponse(token=2), BlsResponse(token=3)])
    for _ in bls_responses(request, Caller(request.events)):
        break  # answered: the caller is not asked again
    assert request.events == ["took 1", "asked", "took 2", "took 3"]
    assert kept() == request.iterators


def test_leaving_after_the_last_response_keeps_nothing():
    request = BlsRequest([BlsResponse(token=1)])
    for _ in bls_responses(request, Caller(request.events)):
        break
    assert request.events == ["took 1", "asked"] and kept() == []


def test_the_responses_of_a_cancelled_caller_are_kept_a_while(monkeypatch):
    """A cancelled caller answers from a cache, with no round trip to the stub, so nothing says that the stub has let
    go: the responses are kept KEEP_SECONDS, and let go of at a later keep."""
    clock = [100.0]
    monkeypatch.setattr(bls_calls.time, "monotonic", lambda: clock[0])
    first = BlsRequest([BlsResponse(token=1)])
    assert [cancelled for _, cancelled in bls_responses(first, Caller(first.events, cancelled=True))] == [True]
    assert kept() == first.iterators
    clock[0] += bls_calls.KEEP_SECONDS
    second = BlsRequest([BlsResponse(token=1)])
    list(bls_responses(second, Caller(second.events, cancelled=True)))
    assert kept() == second.iterators


def test_a_finalize_lets_go_of_the_kept_responses_once_the_youngest_has_been_kept_long_enough(monkeypatch):
    """release_kept: left to the interpreter's exit, kept responses were destroyed after the stub had closed its
    shared memory, and vllm_model's stub aborted (boost's lock_exception) at every test server's stop."""
    clock, slept = [100.0], []
    monkeypatch.setattr(bls_calls.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(bls_calls.time, "sleep", slept.append)
    for offset in (0.0, 4.0):  # two cancelled calls, 4 s apart
        clock[0] += offset
        request = BlsRequest([BlsResponse(token=1)])
        list(bls_responses(request, Caller(request.events, cancelled=True)))
    assert len(kept()) == 2
    bls_calls.release_kept()
    assert slept == [bls_calls.KEEP_SECONDS] and kept() == []
    bls_calls.release_kept()  # nothing kept: no wait
    assert slept[1:] == [0.0]


NOT_READY = "Failed for execute the inference request. Model 'glm' is not ready."


def tokens(request):
    return [response.token for response, _ in exec_latest(request, Caller(request.events))]


def messages(request):
    return [response.message for response, _ in exec_latest(request, Caller(request.events))]


def test_a_request_for_the_latest_version_refused_as_not_ready_is_sent_again():
    """A rollback unloads the highest version while requests for "latest" arrive: Triton may refuse one that never
    reached a model, and bls / vllm_model send it again rather than fail it."""
    request = BlsRequest([BlsResponse(NOT_READY)], [BlsResponse(NOT_READY)], [BlsResponse(token=7), BlsResponse()])
    assert tokens(request) == [7, None]
    assert request.sent == 3 and kept() == []


def test_other_errors_and_endless_refusals_are_passed_on():
    invalid = BlsRequest([BlsResponse("[INVALID_ARG] input 'temperature' must be >= 0"), BlsResponse()])
    assert messages(invalid) == ["[INVALID_ARG] input 'temperature' must be >= 0", None]
    assert invalid.sent == 1
    gone = BlsRequest(*[[BlsResponse(NOT_READY)]] * 4)  # no version of glm comes back: the fourth refusal is final
    assert messages(gone) == [NOT_READY]
    assert gone.sent == 4
    silent = BlsRequest([])
    assert messages(silent) == [] and silent.sent == 1
