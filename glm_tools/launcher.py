"""Start the real `tritonserver` (shipped inside the PyPI package nvidia-pytriton) on this repository's models.

Used by scripts/serve.sh (through scripts/triton_server.py), the integration tests, the benchmarks and
docker-compose.yml, so all run the server the same way:

    python scripts/triton_server.py [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--model-dir DIR]

It assembles a backend directory under .build/backends/ holding Triton's `python` backend (from the wheel) and
this repository's `python_glm` backend, starts the server with the flags in `server_args`, waits for
/v2/health/ready, and stops the server and its Python stub processes on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Settings of the process that starts the server which must not reach the server: the tests run Triton-language
# kernels in Triton's interpreter, and a server started from a test or a benchmark must compile them.
PROCESS_ONLY_ENV = ("TRITON_INTERPRET",)
MODEL_REPOSITORY = os.path.join(REPO, "model_repository")
BACKEND_SOURCE = os.path.join(REPO, "backends", "python_glm")
BUILD_BACKENDS = os.path.join(REPO, ".build", "backends")


def pytriton_root() -> str:
    root = os.path.join(sysconfig.get_paths()["purelib"], "pytriton", "tritonserver")
    if not os.path.isdir(root):
        sys.exit(f"tritonserver not found at {root}: install nvidia-pytriton (scripts/setup_env.sh does)")
    return root


def prepare_backend_dir(target: str = BUILD_BACKENDS) -> str:
    """target/python: Triton's Python backend and the stub for this Python; target/python_glm: ours (a link)."""
    root = pytriton_root()
    python_dir = os.path.join(target, "python")
    os.makedirs(python_dir, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for source in (os.path.join(root, "backends", "python", "libtriton_python.so"),
                   os.path.join(root, "backends", "python", "triton_python_backend_utils.py"),
                   os.path.join(root, "python_backend_stubs", version, "triton_python_backend_stub")):
        destination = os.path.join(python_dir, os.path.basename(source))
        if not os.path.exists(destination) or os.path.getmtime(destination) < os.path.getmtime(source):
            shutil.copy2(source, destination)
    link = os.path.join(target, "python_glm")
    if os.path.islink(link) and os.readlink(link) != BACKEND_SOURCE:
        os.unlink(link)
    if not os.path.islink(link):
        os.symlink(BACKEND_SOURCE, link)
    return target


def server_args(http_port: int, grpc_port: int, metrics_port: int,
                model_repository: str = MODEL_REPOSITORY, backend_dir: str = BUILD_BACKENDS) -> list[str]:
    """The server's flags: the single place they are written down."""
    return [
        f"--model-repository={model_repository}",
        f"--backend-directory={backend_dir}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--exit-on-error=true",
        "--strict-readiness=true",
        "--log-verbose=0",
    ]


def server_env(model_dir: str | None, bundled: bool = True) -> dict[str, str]:
    """This process's environment without PROCESS_ONLY_ENV, with the checkpoint; for the server bundled in
    nvidia-pytriton, also its libraries and this environment's python3 first on PATH."""
    env = {key: value for key, value in os.environ.items() if key not in PROCESS_ONLY_ENV}
    if bundled:
        libs = os.path.join(os.path.dirname(os.path.dirname(pytriton_root())), "nvidia_pytriton.libs")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH")) if p)
        # The Python stub imports the packages of the environment whose python3 comes first on PATH: ours.
        env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
    if model_dir:
        env["GLM_MODEL_DIR"] = os.path.abspath(model_dir)
    return env


def model_repository_with(engine_parameters: dict[str, str], directory: str) -> str:
    """A copy of the model repository in `directory` whose glm config.pbtxt has these engine parameters instead;
    returns its path. For servers with other engine settings (the tests' small limits, benchmarks)."""
    repository = os.path.join(directory, "model_repository")
    shutil.copytree(MODEL_REPOSITORY, repository)
    config_path = os.path.join(repository, "glm", "config.pbtxt")
    with open(config_path) as f:
        config = f.read()
    for key, value in engine_parameters.items():
        config, found = re.subn(rf'(key: "{key}", value: {{ string_value: )"[^"]*"', rf'\1"{value}"', config)
        if not found:
            raise ValueError(f"glm's config.pbtxt has no parameter {key!r}")
    with open(config_path, "w") as f:
        f.write(config)
    return repository


def free_port() -> int:
    """A TCP port nothing listens on now: for servers that must not collide with one already running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_with_parent() -> None:
    """Run in the child before exec: Linux sends it SIGTERM when the thread that started it dies, so a killed test
    run or benchmark leaves no server behind (they did, using the CPU of whatever ran next)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class TritonServer:
    """A running tritonserver process group; a context manager that always stops it."""

    def __init__(self, http_port=8000, grpc_port=8001, metrics_port=8002, model_dir=None,
                 model_repository=MODEL_REPOSITORY, log_path=None, extra_env=None, installed_server=None):
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.model_dir, self.model_repository, self.log_path = model_dir, model_repository, log_path
        self.extra_env = extra_env or {}
        # (binary, backend directory) of an installed Triton (the NGC image); None: the one in nvidia-pytriton.
        self.installed_server = installed_server
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def start(self) -> "TritonServer":
        if self.installed_server:
            binary, backend_dir = self.installed_server
        else:
            binary, backend_dir = os.path.join(pytriton_root(), "bin", "tritonserver"), prepare_backend_dir()
        env = server_env(self.model_dir, bundled=not self.installed_server)
        command = [binary, *server_args(self.http_port, self.grpc_port, self.metrics_port, self.model_repository,
                                        backend_dir)]
        output = open(self.log_path, "w") if self.log_path else None
        # A session of its own, so stopping it also stops the Python stub processes it started.
        self.process = subprocess.Popen(command, env={**env, **self.extra_env},
                                        stdout=output, stderr=subprocess.STDOUT if output else None,
                                        start_new_session=True, preexec_fn=stop_with_parent)
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # Triton finishes in-flight requests, then unloads models
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        finally:
            try:  # stubs that outlived the server
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run tritonserver on Open-AutoGLM's model repository.")
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--model-dir", default=os.environ.get("GLM_MODEL_DIR"),
                        help="GLM checkpoint to serve (default: model_dir in the models' config.pbtxt)")
    parser.add_argument("--model-repository", default=MODEL_REPOSITORY)
    parser.add_argument("--installed-triton", metavar="DIR",
                        help="use an installed Triton (e.g. /opt/tritonserver in the NGC image) instead of the one in "
                             "nvidia-pytriton; its backends/ folder must hold python_glm")
    args = parser.parse_args(argv)

    installed = None
    if args.installed_triton:
        installed = (os.path.join(args.installed_triton, "bin", "tritonserver"),
                     os.path.join(args.installed_triton, "backends"))
    server = TritonServer(args.http_port, args.grpc_port, args.metrics_port, args.model_dir, args.model_repository,
                          installed_server=installed)
    stop_requested = []
    # Explicit handlers: a launcher started in the background inherits SIGINT as ignored, and Ctrl-C must work.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_requested.append(True))
    print(f"[serve] starting tritonserver (HTTP {args.http_port}, gRPC {args.grpc_port}, "
          f"metrics {args.metrics_port})...", flush=True)
    started = time.monotonic()
    server.start()
    try:
        while not (stop_requested or server.is_ready()):
            if server.process.poll() is not None:
                print(f"[serve] tritonserver exited with code {server.process.returncode} before it was ready; "
                      "its log is above", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        if not stop_requested:
            print(f"""
[serve] ready in {time.monotonic() - started:.0f}s. Try:
  curl -s -X POST localhost:{args.http_port}/v2/models/ensemble/generate \\
       -d '{{"text_input": "Hello, GLM", "max_tokens": 32}}'
  curl -s -N -X POST localhost:{args.http_port}/v2/models/ensemble/generate_stream \\
       -d '{{"text_input": "Hello, GLM", "max_tokens": 32, "stream": true}}'
  gRPC on localhost:{args.grpc_port}, Prometheus metrics on localhost:{args.metrics_port}/metrics.
[serve] Ctrl-C stops the server.""", flush=True)
        while not stop_requested and server.process.poll() is None:
            time.sleep(0.5)
    finally:
        print("\n[serve] stopping tritonserver...", flush=True)
        server.stop()
    return 0 if server.process.returncode in (0, -signal.SIGTERM, -signal.SIGKILL) else server.process.returncode
