"""Runs an LLMEngine on its own thread, so callers (Triton's execute) only submit and are called back.

Requests join the running batch between steps; each step's outputs go to the request's callback on the engine
thread. A callback that returns False (its client went away) has its request aborted before the next step.

`drain` prepares a shutdown: new requests are refused, running ones get a grace period to finish, then end with an
error saying the server is shutting down. `stalled_for` tells a watchdog how long the thread has been busy without
finishing a step (infinite once the thread has died), `fault` why the engine can no longer run. A FatalEngineError
(a tensor-parallel rank lost) fails every request in flight and ends the thread; later requests are refused.

The engine is also built on that thread, so that only one thread ever runs torch's parallel CPU kernels: each
thread that does gets its own OpenMP worker pool, and once a process has more OpenMP threads than cores, libgomp
stops spin-waiting and puts workers to sleep at every barrier: loading on Triton's thread and stepping on this one
made every CPU step slower (docs/performance.md).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Callable

from .engine import SHUTTING_DOWN, LLMEngine, RequestOutput, Unavailable
from .model_runner import FatalEngineError
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], bool]


class EngineThread:
    def __init__(self, build_engine: Callable[[], LLMEngine],
                 on_step: Callable[[LLMEngine], None] | None = None):
        """Calls `build_engine` on the new thread and waits for it; what it raises is raised here.
        `on_step` runs on the engine thread after every step and whenever the engine falls idle (metrics)."""
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        # Requests submitted and not yet added to the engine, which admission counts as waiting.
        self._queued_lock = threading.Lock()
        self._queued_requests = self._queued_tokens = 0
        self._stopping = False
        self._drain_deadline: float | None = None  # time.monotonic() after which running requests are ended
        self._busy_since: float | None = None  # when the current unit of work began; None while idle
        self._fatal: str | None = None  # the FatalEngineError that ended the thread
        self.engine: LLMEngine | None = None
        build_error: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, args=(build_engine, build_error), name="glm-engine",
                                        daemon=True)
        self._thread.start()
        error = build_error.get()
        if error is not None:
            raise error

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               on_output: OutputCallback, leader_id: str | None = None) -> None:
        """Queue a request (`leader_id`: see LLMEngine.add_request). Raises at once, on the caller's thread:
        ValueError if it can never be served, Overloaded if the engine's admission limits refuse it now, Unavailable
        if the engine is draining."""
        if self._drain_deadline is not None:
            raise Unavailable(SHUTTING_DOWN)
        if not self._thread.is_alive():
            raise Unavailable(SHUTTING_DOWN if self._fatal is None else
                              "the engine has stopped after a fault; the server restarts this model: retry")
        self.engine.check_request(prompt_token_ids, params)
        with self._queued_lock:
            self.engine.check_admission(len(prompt_token_ids), self._queued_requests, self._queued_tokens)
            self._queued_requests += 1
            self._queued_tokens += len(prompt_token_ids)
        self._inbox.put(("add", request_id, prompt_token_ids, params, on_output, leader_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def drain(self, grace_s: float) -> None:
        """Refuse new requests from now on; running and waiting ones that have not finished `grace_s` seconds from now
        end with an error saying the server is shutting down (retryable: HTTP 503)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + grace_s

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def stalled_for(self) -> float:
        """Seconds since the engine thread last finished a step while it has work (0 while idle); infinite once the
        thread has died."""
        if not self._thread.is_alive():
            return math.inf
        busy_since = self._busy_since
        return 0.0 if busy_since is None else time.monotonic() - busy_since

    def fault(self) -> str | None:
        """Why the engine can no longer run (a FatalEngineError ended the thread, or LLMEngine.fault), or None."""
        if self._fatal is not None:
            return self._fatal
        return self.engine.fault() if self.engine is not None else None

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop the thread. With grace_s, drain first: running requests get grace_s to finish (those left end with
        the retryable shutting-down error) and the thread stops once idle; requests still there are aborted."""
        if grace_s > 0 and self._thread.is_alive():
            self.drain(grace_s)
            deadline = time.monotonic() + grace_s + 5
            while time.monotonic() < deadline and (self._busy_since is not None or not self._inbox.empty()):
                time.sleep(0.05)
        self._stopping = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)

    def _main(self, build_engine: Callable[[], LLMEngine], build_error: queue.SimpleQueue) -> None:
        try:
            self.engine = build_engine()
        except BaseException as exc:
            build_error.put(exc)
            return
        build_error.put(None)
        try:
            self._run()
        except FatalEngineError as exc:
            self._fatal = f"the engine cannot go on: {exc}"
            log.critical(self._fatal)
            for output in self.engine.fail_all(f"engine failure: {exc}; retry", unavailable=True):
                self._deliver(output)
        finally:
            for request_id in list(self._callbacks):
                self._abort(request_id)
            self._refuse_queued()
            self.engine.close(kill=self._fatal is not None)

    def _run(self) -> None:
        while not self._stopping:
            # Block while idle; otherwise take whatever arrived since the last step and go on.
            self._busy_since = None
            message = self._inbox.get()
            self._busy_since = time.monotonic()
            self._handle(message)
            while not self._inbox.empty():
                self._handle(self._inbox.get())
            while self.engine.has_unfinished_requests() and not self._stopping:
                for output in self._step():
                    self._deliver(output)
                while not self._inbox.empty():
                    self._handle(self._inbox.get())
                self._notify_step()
                self._busy_since = time.monotonic()
            self._notify_step()

    def _step(self) -> list[RequestOutput]:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            return self.engine.fail_all(SHUTTING_DOWN, unavailable=True)
        try:
            return self.engine.step()
        except FatalEngineError:
            raise
        except Exception as exc:  # a bug must fail the requests in flight, not hang them and all later ones
            log.exception("engine step failed unexpectedly")
            return self.engine.fail_all(f"engine failure: {exc}")

    def _refuse_queued(self) -> None:
        """Answer the requests submitted but never added: the thread is ending."""
        while not self._inbox.empty():
            message = self._inbox.get()
            if message[0] == "add":
                _, request_id, _, _, on_output, _ = message
                self._call(on_output, RequestOutput(request_id, [], finished=True, error=SHUTTING_DOWN,
                                                    unavailable=True))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, on_output, leader_id = message
            with self._queued_lock:
                self._queued_requests -= 1
                self._queued_tokens -= len(prompt)
            try:
                self.engine.add_request(request_id, prompt, params, leader_id)
            except ValueError as exc:
                self._call(on_output, RequestOutput(request_id, [], finished=True, error=str(exc)))
                return
            self._callbacks[request_id] = on_output
        elif kind == "abort":
            self._abort(message[1])

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        callback = self._callbacks.pop(request_id, None)
        if output is not None and callback is not None:
            self._call(callback, output)

    def _deliver(self, output: RequestOutput) -> None:
        callback = self._callbacks.get(output.request_id)
        if callback is None:
            return
        if output.finished:
            del self._callbacks[output.request_id]
        if not self._call(callback, output) and not output.finished:
            self._abort(output.request_id)

    def _notify_step(self) -> None:
        if self._on_step is not None:
            try:
                self._on_step(self.engine)
            except Exception:
                log.exception("on_step hook failed")

    @staticmethod
    def _call(callback: OutputCallback, output: RequestOutput) -> bool:
        try:
            return callback(output) is not False
        except Exception:  # a broken callback must not stop the engine for everyone else
            log.exception("output callback for %s failed", output.request_id)
            return False
