"""Keeps one tritonserver serving: the launcher's loop (scripts/serve.sh, docker-compose.yml, Kubernetes).

Triton 2.51 does not notice when a Python model's process dies: /v2/health/ready stays 200, requests in flight hang,
and every new one fails with "Stub process is not healthy" until someone restarts the server. The supervisor watches
for that and for the other ways a server stops serving, and restarts it:
- the server exits;
- a model's stub process dies while its model is loaded (a crash, the OOM killer, kill -9, or glm's watchdog ending
  an engine thread that stalled or died: glm_engine/watchdog.py);
- the server is not ready within ready_timeout_s of its start.
A restart kills the server at once: clients with requests in flight get a connection error rather than a hang, and
health checks fail (nothing listens) until the new server is ready. After more than max_restarts restarts within
restart_window_s the supervisor gives up with exit status 1, for the restart policy of compose or Kubernetes, with
its back-off, to take over.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time
from typing import Callable

from .launcher import (ADMIN_KEY_ENV, ALLOCATORS, DRAIN_GRACE_S, MODEL_REPOSITORY, TritonServer, allocator_library,
                       remove_stale_shm_regions, start_openai_front)


def say(message: str, error: bool = False) -> None:
    print(f"[serve] {message}", file=sys.stderr if error else sys.stdout, flush=True)


def model_states(server: TritonServer) -> dict[tuple[str, str], str]:
    """Each (model, version)'s state in the repository index ("READY", "UNAVAILABLE: reason", ...); {} if it cannot
    be read within 10 s (a server too busy to answer its index must not delay the decision to restart it)."""
    return {(entry["name"], entry.get("version", "")): entry.get("state", "?")
            + (f": {entry['reason']}" if entry.get("reason") else "")
            for entry in server.repository(timeout_s=10.0) or []}


class Supervisor:
    def __init__(self, new_server: Callable[[], TritonServer], ready_timeout_s: float = 600.0, max_restarts: int = 5,
                 restart_window_s: float = 600.0, poll_s: float = 0.5):
        self.new_server = new_server
        self.ready_timeout_s = ready_timeout_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.poll_s = poll_s
        self.server: TritonServer | None = None

    def run(self, stop: threading.Event, on_ready: Callable[[float, int], None]) -> int:
        """Serve until `stop` is set (then drain and stop: 0) or the restarts run out (1). on_ready(seconds the start
        took, restarts so far) is called each time a server becomes ready."""
        restarts: list[float] = []
        while True:
            self.server = self.new_server().start()
            failure = self._serve(self.server, stop, lambda seconds: on_ready(seconds, len(restarts)))
            if failure is None:
                say("stopping tritonserver: draining the engine first...")
                self.server.stop()
                return 0
            say(f"{failure}: restarting tritonserver", error=True)
            self.server.kill()
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < self.restart_window_s] + [now]
            if len(restarts) > self.max_restarts:
                say(f"giving up after {len(restarts)} restarts within {self.restart_window_s:.0f}s", error=True)
                return 1

    def _serve(self, server: TritonServer, stop: threading.Event, on_ready: Callable[[float], None]) -> str | None:
        """Wait for the server to be ready, then watch it: None once `stop` is set, else why it must be restarted."""
        started = time.monotonic()
        while not server.is_ready():
            if server.process.poll() is not None:
                return f"tritonserver exited with code {server.process.returncode} before it was ready"
            if time.monotonic() - started > self.ready_timeout_s:
                not_ready = {f"{name} {version}": state for (name, version), state in model_states(server).items()
                             if state != "READY"}
                return (f"tritonserver not ready {self.ready_timeout_s:.0f}s after its start (models not ready: "
                        f"{not_ready or 'unknown'})")
            if stop.wait(self.poll_s):
                return None
        # The stubs are counted before anything else: one that dies after the server is ready must be in the count,
        # and on_ready tells the operator (and the tests) that a kill from now on is seen.
        stubs = server.stub_processes()
        server.shm_regions()
        on_ready(time.monotonic() - started)
        while not stop.wait(self.poll_s):
            if server.process.poll() is not None:
                return f"tritonserver exited with code {server.process.returncode}"
            alive = server.stub_processes()
            # A stub that has gone without a successor for its instance of its model version (a reload starts the new
            # one first), while that version is loaded, has died. Two versions of a model (a rollout) have instances
            # of the same names: each is told apart by its version.
            gone = {pid: stub for pid, stub in stubs.items() if pid not in alive and stub not in alive.values()}
            if gone:
                states = model_states(server)
                crashed = {pid: stub for pid, stub in gone.items()
                           if states.get((stub.model, stub.version), "READY") == "READY"}
                if crashed:
                    return "the process of model instance " + ", ".join(
                        f"{stub.instance} of {stub.model} version {stub.version} (pid {pid})"
                        for pid, stub in crashed.items()) + " died while it was loaded"
            stubs = alive  # models loaded or unloaded on purpose come and go
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run tritonserver on Open-AutoGLM's model repository, and keep it serving.")
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--model-dir", default=os.environ.get("GLM_MODEL_DIR"),
                        help="GLM checkpoint to serve (default: model_dir in the models' config.pbtxt)")
    parser.add_argument("--model-repository", default=MODEL_REPOSITORY)
    parser.add_argument("--tensor-parallel-size", type=int, default=int(os.environ.get("GLM_TENSOR_PARALLEL_SIZE", 0)),
                        help="split the model over this many GPUs (docs/scaling.md); default: tensor_parallel_size "
                             "in glm's config.pbtxt (1)")
    parser.add_argument("--installed-triton", metavar="DIR",
                        help="use an installed Triton (e.g. /opt/tritonserver in the NGC image) instead of the one in "
                             "nvidia-pytriton; its backends/ folder must hold python_glm")
    parser.add_argument("--drain-grace", type=float, default=float(os.environ.get("DRAIN_GRACE_S", DRAIN_GRACE_S)),
                        help="on Ctrl-C or SIGTERM, seconds running requests may go on before they end with a "
                             "retryable error (default %(default)s)")
    parser.add_argument("--ready-timeout", type=float, default=float(os.environ.get("READY_TIMEOUT_S", 600)),
                        help="restart a server that is not ready this many seconds after its start "
                             "(default %(default)s)")
    parser.add_argument("--allocator", choices=("auto", *ALLOCATORS, "system"),
                        default=os.environ.get("GLM_ALLOCATOR", "auto"),
                        help="memory allocator of the server and its stubs; auto: jemalloc if installed "
                             "(default %(default)s)")
    parser.add_argument("--host", default=os.environ.get("GLM_HOST", "127.0.0.1"),
                        help="address to listen on; 0.0.0.0 for every interface (default %(default)s)")
    parser.add_argument("--openai-port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)),
                        help="port of the OpenAI-compatible API (openai_front/; API key from GLM_OPENAI_API_KEY); "
                             "0 turns it off (default %(default)s)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="give up (exit 1) after more restarts than this within 10 minutes (default %(default)s)")
    args = parser.parse_args(argv)

    installed = None
    if args.installed_triton:
        installed = (os.path.join(args.installed_triton, "bin", "tritonserver"),
                     os.path.join(args.installed_triton, "backends"))
    remove_stale_shm_regions()
    try:
        library = allocator_library(args.allocator)
    except FileNotFoundError as exc:
        say(str(exc), error=True)
        return 2
    say(f"memory allocator: {library}" if library else
        "memory allocator: the system's malloc (install Debian's libjemalloc2 for jemalloc: docs/operations.md)")
    admin_key = os.environ.get(ADMIN_KEY_ENV)
    if not admin_key:  # one key for every restart, so that an operator's key stays valid
        admin_key = secrets.token_hex(16)
        say(f"control-plane key (set {ADMIN_KEY_ENV} to choose it): {admin_key}")
    # Read by glm (triton_glm/common.py, TENSOR_PARALLEL_ENV) over its config.pbtxt.
    engine_env = {"GLM_TENSOR_PARALLEL_SIZE": str(args.tensor_parallel_size)} if args.tensor_parallel_size else {}
    supervisor = Supervisor(
        lambda: TritonServer(args.http_port, args.grpc_port, args.metrics_port, args.model_dir, args.model_repository,
                             extra_env=engine_env, installed_server=installed, drain_grace_s=args.drain_grace,
                             allocator=args.allocator, host=args.host, admin_key=admin_key),
        ready_timeout_s=args.ready_timeout, max_restarts=args.max_restarts)
    stop = threading.Event()
    # Explicit handlers: a launcher started in the background inherits SIGINT as ignored, and Ctrl-C must work.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    def on_ready(seconds: float, restarts: int) -> None:
        if restarts:
            say(f"ready again in {seconds:.0f}s (restart {restarts})")
            return
        openai_hint = (f"\n  OpenAI API: http://localhost:{args.openai_port}/v1 (model 'glm'), e.g. with the openai "
                       "package's OpenAI(base_url=...)." if args.openai_port else "")
        say(f"""ready in {seconds:.0f}s. Try:
  curl -s -X POST localhost:{args.http_port}/v2/models/ensemble/generate \\
       -d '{{"text_input": "Hello, GLM", "max_tokens": 32}}'
  curl -s -N -X POST localhost:{args.http_port}/v2/models/ensemble/generate_stream \\
       -d '{{"text_input": "Hello, GLM", "max_tokens": 32, "stream": true}}'
  gRPC on localhost:{args.grpc_port}, Prometheus metrics on localhost:{args.metrics_port}/metrics.{openai_hint}
[serve] Ctrl-C stops the server.""")

    say(f"starting tritonserver (HTTP {args.http_port}, gRPC {args.grpc_port}, metrics {args.metrics_port})...")
    front = None
    if args.openai_port:
        say(f"OpenAI-compatible API on {args.host}:{args.openai_port}/v1 (--openai-port 0 turns it off)")
        front = start_openai_front(f"127.0.0.1:{args.grpc_port}", args.openai_port, args.host, args.model_dir)
    try:
        return supervisor.run(stop, on_ready)
    finally:
        if front is not None:
            front.terminate()
        if supervisor.server is not None:  # an exception above: leave nothing running
            supervisor.server.kill()

