"""Decoupled BLS calls (request.exec(decoupled=True)) and what Triton 2.51's Python backend needs of them: the
caller's cancellation checked before each response, the stub's own reference to a call's responses released before
Python's, and a request for glm's latest version that Triton refuses as not ready sent again."""

from __future__ import annotations

import collections
import logging
import re
import threading
import time

log = logging.getLogger(__name__)

# Triton's refusal of a BLS request for glm's latest version when that version began unloading between the two
# lookups of its readiness check (python_backend's RequestExecutor::Infer; triton-inference-server/core's
# ModelIsReady): a rollback unloads the highest version while requests for "latest" arrive. The request never reached
# a model, so it is sent again, to the version that is latest now.
NOT_READY_REFUSAL = re.compile(r"Failed for execute the inference request\. Model '[^']*' is not ready\.")
NOT_READY_RETRIES = (0.05, 0.2, 0.5, 1.0)  # seconds before each retry

# How long the responses of a call are kept after it when nothing says that the stub has let go (see bls_responses).
KEEP_SECONDS = 10.0
_kept: collections.deque = collections.deque()  # (when to let go, response iterator), oldest first
_kept_lock = threading.Lock()


def bls_responses(callee_request, caller):
    """Yields (response, cancelled) for each response of callee_request.exec(decoupled=True). `cancelled`: whether
    the client of `caller` (the request, or the response sender, being answered) has gone away, asked after the
    response arrived and before it is yielded. Once it has answered its caller, the consumer must stop iterating
    (`break`): the caller must not be asked again; the rest of the call is then taken here.

    Why that order matters: Triton 2.51's stub frees a BLS response's numpy arrays without holding the GIL when its
    utils thread, not Python, drops the last reference to a finished response iterator (python_backend#390, fixed in
    24.12). That corrupts Python's allocator, and the stub dies under concurrent clients (segfaults in libpython's
    string code). The utils thread drops its reference as it handles the clean-up that the iterator queues on taking
    the last response, and is_cancelled() is answered through the same thread, in order: once it returns after the
    last response, Python holds the only reference. A cancelled caller answers from a cache, without that round
    trip, and a consumer that left before the last response was not asked after it: then the responses are kept
    KEEP_SECONDS after the call."""
    responses = callee_request.exec(decoupled=True)
    cancelled = False
    try:
        for response in responses:  # the one iter(): pb_utils' iterator starts over at each once it has finished
            cancelled = caller.is_cancelled()
            yield response, cancelled
    finally:
        # A consumer that left early: the stub cleans up only a call whose last response was taken (next(), not a
        # second iter()).
        left_early = False
        while next(responses, None) is not None:
            left_early = True
        if cancelled or left_early:
            _keep_a_while(responses)


def _keep_a_while(responses) -> None:
    now = time.monotonic()
    with _kept_lock:
        while _kept and _kept[0][0] <= now:
            _kept.popleft()
        _kept.append((now + KEEP_SECONDS, responses))


def release_kept() -> None:
    """Let go of the kept responses while the stub still runs (a model's finalize calls this): left to the
    interpreter's exit, they were destroyed after the stub had closed its shared memory, and the process aborted with
    boost's lock_exception. Waits until the youngest has been kept KEEP_SECONDS (at most that long, only after a call
    that recent)."""
    with _kept_lock:
        youngest = _kept[-1][0] if _kept else 0.0
    time.sleep(max(0.0, youngest - time.monotonic()))
    with _kept_lock:
        _kept.clear()


def exec_latest(callee_request, caller):
    """bls_responses for a request to a model's latest version, sent again while Triton refuses it as not ready (see
    NOT_READY_REFUSAL); the last refusal is passed on."""
    for delay in (*NOT_READY_RETRIES, None):
        responses = bls_responses(callee_request, caller)
        first = next(responses, None)
        refused = (delay is not None and first is not None and first[0].has_error()
                   and NOT_READY_REFUSAL.search(first[0].error().message()))
        if not refused:
            if first is not None:
                yield first
                yield from responses
            return
        responses.close()
        log.info("%s; sending the request again in %.2f s", first[0].error().message(), delay)
        time.sleep(delay)
