"""A thread beside the engine thread that watches it on behalf of whoever runs the process.

- **Drain.** A launcher that wants the engine drained before it stops the server writes the grace period, in seconds,
  into the file named by GLM_DRAIN_FILE (glm_tools.launcher does). The watchdog sees it within a poll and drains the
  engine thread: no new requests, running ones finish or end with a retryable error when the grace period is over.
- **Stall.** If the engine thread has died, or has been busy for `stall_timeout_s` without finishing a step, requests
  would hang with no error and health checks would not notice. The watchdog ends the whole process instead: a dead
  model process is what the launcher's supervisor detects and heals, by restarting the server
  (docs/operations.md).
- **Fault.** Likewise, at once and whatever stall_timeout_s says, when the engine reports a fault it cannot recover
  from (a tensor-parallel worker process has died: rank 0 may be waiting for it in a collective).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from .engine_thread import EngineThread

log = logging.getLogger(__name__)

DRAIN_FILE_ENV = "GLM_DRAIN_FILE"
# The exit status of a process the watchdog ended (EX_SOFTWARE), so that logs tell it from a crash.
STALLED_EXIT_STATUS = 70


class Watchdog:
    def __init__(self, engine_thread: EngineThread, stall_timeout_s: float, drain_file: str | None = None,
                 poll_s: float = 0.5, exit_process: Callable[[int], None] = os._exit):
        """stall_timeout_s 0: never end the process. drain_file: default from GLM_DRAIN_FILE; None or "": no drain.
        exit_process: how to end the process (tests replace it)."""
        self.engine_thread = engine_thread
        self.stall_timeout_s = stall_timeout_s
        self.drain_file = drain_file if drain_file is not None else os.environ.get(DRAIN_FILE_ENV, "")
        self.poll_s = poll_s
        self.exit_process = exit_process
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="glm-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            if not self.engine_thread.draining and (grace_s := self._drain_request()) is not None:
                log.info("draining the engine: new requests are refused, running ones have %.0f s to finish", grace_s)
                self.engine_thread.drain(grace_s)
            stalled, reason = self.engine_thread.stalled_for(), self.engine_thread.fault()
            if reason is None and self.stall_timeout_s and stalled > self.stall_timeout_s:
                reason = ("the engine thread has died" if stalled == float("inf") else
                          f"the engine thread has made no progress for {stalled:.0f} s (stall_timeout_s "
                          f"{self.stall_timeout_s:g})")
            if reason is not None:
                log.critical("%s: ending this model's process so that it is restarted", reason)
                logging.shutdown()
                self.exit_process(STALLED_EXIT_STATUS)
                return

    def _drain_request(self) -> float | None:
        """The grace period written into the drain file, once it exists."""
        if not self.drain_file:
            return None
        try:
            with open(self.drain_file) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        try:
            return max(0.0, float(text))
        except ValueError:
            log.warning("drain file %s holds %r, not a number of seconds: draining with no grace", self.drain_file,
                        text)
            return 0.0
