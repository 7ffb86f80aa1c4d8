"""Clients sending requests back to back through every front until stopped, each result recorded: the load under
which the version tests and scripts/bench_rollout.py change versions."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from clients import GrpcClient, HttpClient


@dataclass
class Result:
    client: str  # its kind: KINDS' first field
    started: float  # time.monotonic()
    ended: float
    version: int | None  # the glm version that answered
    finish_reason: str
    error: str | None  # the exception, for a failed request


class ClientLoad:
    """per_kind clients of each kind: the ensemble streaming over HTTP and over gRPC, and bls over HTTP and over gRPC
    (the SDK's clients), each asking for 8 to 24 tokens per request. A context manager: the clients run inside it."""

    KINDS = (("ensemble-http-stream", HttpClient, "ensemble", True),
             ("ensemble-grpc-stream", GrpcClient, "ensemble", True),
             ("bls-http", HttpClient, "bls", False),
             ("bls-grpc", GrpcClient, "bls", False))

    def __init__(self, http_url: str, grpc_url: str, per_kind: int = 4):
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(http_url, grpc_url, kind, n), daemon=True)
                         for kind in self.KINDS for n in range(per_kind)]

    def __enter__(self) -> "ClientLoad":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _run(self, http_url: str, grpc_url: str, kind, n: int) -> None:
        name, client_class, model, streaming = kind
        rng = random.Random(n)
        with client_class(http_url if client_class is HttpClient else grpc_url, model=model, timeout=120) as client:
            while not self._stopping.is_set():
                started = time.monotonic()
                version, reason, error = None, "", None
                try:
                    max_tokens = rng.randint(8, 24)
                    if streaming:
                        generation = client.stream(f"client {n} says", max_tokens=max_tokens,
                                                   ignore_eos=True).until_done()
                    else:
                        generation = client.generate(f"client {n} asks", max_tokens=max_tokens, ignore_eos=True)
                    version, reason = generation.glm_version, generation.finish_reason
                except Exception as exc:  # a failed request: recorded, never raised
                    error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.results.append(Result(name, started, time.monotonic(), version, reason, error))

    def finished_between(self, start: float, end: float) -> list[Result]:
        """The requests that started at `start` or later and ended by `end`."""
        with self._lock:
            return [r for r in self.results if r.started >= start and r.ended <= end]

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def failed(self) -> list[Result]:
        """Requests that raised, or ended other than at their max_tokens (ignore_eos: "length" is the only end)."""
        with self._lock:
            return [r for r in self.results if r.error or r.finish_reason != "length"]
