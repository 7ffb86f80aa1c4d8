"""Start the real `tritonserver` (shipped inside the PyPI package nvidia-pytriton) on this repository's models.

Used by scripts/serve.sh (through scripts/triton_server.py), the integration tests, the benchmarks and
docker-compose.yml, so all run the server the same way:

    python scripts/triton_server.py [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--model-dir DIR]

(glm_tools/supervisor.py's main, which keeps the server serving: restarts on a model process's death or a start
that never gets ready). TritonServer assembles a backend directory under .build/backends/ holding Triton's `python`
backend (from the wheel) and this repository's `python_glm` backend, starts the server with the flags in
`server_args`, and on stop() drains the engine, stops the server and removes the shared memory its stubs left.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Settings of the process that starts the server which must not reach the server: the tests run Triton-language
# kernels in Triton's interpreter, and a server started from a test or a benchmark must compile them.
PROCESS_ONLY_ENV = ("TRITON_INTERPRET",)
MODEL_REPOSITORY = os.path.join(REPO, "model_repository")
DEMO_CHECKPOINT = os.path.join(REPO, "checkpoints", "glm-demo")
BACKEND_SOURCE = os.path.join(REPO, "backends", "python_glm")
BUILD_BACKENDS = os.path.join(REPO, ".build", "backends")
# How long Triton waits on SIGTERM, for idle HTTP connections to close and then for requests in flight, before it
# exits without unloading its models. stop() has drained the engine and unloaded the models by then.
EXIT_TIMEOUT_S = 10
# The header that the control plane requires, on HTTP and gRPC: only a caller that knows the server's key (the
# launcher; an operator through GLM_ADMIN_KEY) can load or unload a model (a load may carry files: Python code the
# server would run), register shared memory, or change logging and tracing. Inference, health, metadata, model
# configs and statistics stay open.
ADMIN_KEY_HEADER = "glm-admin-key"
GRPC_ADMIN_KEY_HEADER = f"triton-grpc-protocol-{ADMIN_KEY_HEADER}"  # the metadata key gRPC callers send it under
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"
ADMIN_KEY_ENV = "GLM_ADMIN_KEY"
# On stop(), how long running requests may go on generating before they end with a retryable error.
DRAIN_GRACE_S = 20.0
# The stack of each of the server's threads. Triton 2.51 parses a JSON request body recursively (RapidJSON without
# its iterative mode; fixed upstream in 2026), about 200 bytes of the HTTP thread's stack a level of nesting: with
# Linux's usual 8 MiB, one 120 kB body of 60,000 nested brackets crashed the server. A thread's stack size is taken
# from RLIMIT_STACK when the process starts; 1 GiB (address space: only the pages touched are memory) takes some
# 5 million levels, more than an 8 MB body holds (docs/operations.md: what is left, and the ingress' body limit).
SERVER_STACK_BYTES = 2**30
OVERCOMMIT_SETTING = "/proc/sys/vm/overcommit_memory"
DRAIN_FILE_ENV = "GLM_DRAIN_FILE"  # read by glm_engine.watchdog, which this package must not import (no torch here)
# Memory allocators the server and its stubs can run with (LD_PRELOAD). In a 30-minute soak with glibc's malloc, glm's
# process grew 446 MB an hour; with jemalloc it stayed flat (docs/operations.md#memory-over-time-soak). "auto": jemalloc
# when Debian's libjemalloc2 is installed, else the system's malloc.
ALLOCATORS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
STUB_NAME = "triton_python_b"  # the Python backend's stub processes, as /proc/PID/comm shows them (15 characters)
SHM_PATTERN = "/dev/shm/triton_python*_shm_region_*"


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


def server_args(http_port: int, grpc_port: int, metrics_port: int, model_repository: str = MODEL_REPOSITORY,
                backend_dir: str = BUILD_BACKENDS, admin_key: str = "", host: str = "127.0.0.1") -> list[str]:
    """The server's flags: the single place they are written down. Models are loaded through the model-repository
    API (all of them at the start), which, like the rest of RESTRICTED_APIS, only callers that send admin_key may
    use."""
    restricted = f"{RESTRICTED_APIS}:{ADMIN_KEY_HEADER}={admin_key}"
    return [
        f"--model-repository={model_repository}",
        f"--backend-directory={backend_dir}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        "--log-verbose=0",
        # Start-up (docs/operations.md#start-up): every model loads at once (Triton's default is four at a time), and
        # from its config.pbtxt as written, without a first stub process per model that the Python backend's
        # auto-complete starts (Python, torch, the adapter) only to ask for the config.
        f"--model-load-thread-count={max(4, len(os.listdir(model_repository)))}",
        "--disable-auto-complete-config",
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


def allocator_library(allocator: str) -> str | None:
    """The library to preload for `allocator` ("auto", "jemalloc", "tcmalloc" or "system"); None: the system's
    malloc. Raises FileNotFoundError for an allocator asked for by name that is not installed."""
    if allocator == "system":
        return None
    name = ALLOCATORS["jemalloc" if allocator == "auto" else allocator]
    for directory in LIBRARY_DIRS:
        if os.path.exists(path := os.path.join(directory, name)):
            return path
    if allocator == "auto":
        return None
    raise FileNotFoundError(f"{ALLOCATORS[allocator]} not found in {', '.join(LIBRARY_DIRS)}: install Debian's "
                            f"{'libjemalloc2' if allocator == 'jemalloc' else 'libtcmalloc-minimal4'}")


def start_openai_front(grpc_url: str, port: int, host: str = "127.0.0.1", model_dir: str | None = None,
                       api_key: str | None = None) -> subprocess.Popen:
    """The OpenAI-compatible front (openai_front/) in front of the Triton server at grpc_url, as a child process that
    ends with this one. model_dir: the served checkpoint, for its chat template (default: the demo's)."""
    command = [sys.executable, "-m", "openai_front", "--triton", grpc_url, "--host", host, "--port", str(port),
               "--model-dir", model_dir or DEMO_CHECKPOINT]
    env = {**os.environ, "PYTHONPATH": REPO}
    if api_key:
        env["GLM_OPENAI_API_KEY"] = api_key
    return subprocess.Popen(command, cwd=REPO, env=env, preexec_fn=stop_with_parent)


def wait_for_openai_front(url: str, timeout: float = 60.0) -> None:
    """Wait until the front at url answers /health with 200 (its Triton server is ready); RuntimeError after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the OpenAI front at {url} was not healthy within {timeout:.0f} s")


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port nothing listens on now, and not handed out before by this process: for servers that must not
    collide with one already running. (Linux may offer a port again once it is closed: a server's HTTP, gRPC and
    metrics ports, picked one after another before it starts, once came out equal and the server refused to start.)"""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def stop_with_parent() -> None:
    """Run in the child before exec: Linux sends it SIGTERM when the thread that started it dies, so a killed test
    run or benchmark leaves no server behind (they did, using the CPU of whatever ran next)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def server_stack_limit() -> tuple[int, int] | None:
    """The RLIMIT_STACK to start tritonserver with: SERVER_STACK_BYTES within the hard limit, or None (leave it)
    where Linux counts every mapping against a strict commit limit (vm.overcommit_memory 2), in which the stacks of
    the server's 240 threads would not fit. A soft limit of "unlimited" gives threads glibc's 2 MiB: it is replaced."""
    try:
        with open(OVERCOMMIT_SETTING) as f:
            if f.read().strip() == "2":
                return None
    except OSError:
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    wanted = SERVER_STACK_BYTES if hard == resource.RLIM_INFINITY else min(SERVER_STACK_BYTES, hard)
    return (wanted, hard) if soft == resource.RLIM_INFINITY or soft < wanted else None


class TritonServer:
    """A running tritonserver process group; a context manager that always stops it."""

    def __init__(self, http_port=8000, grpc_port=8001, metrics_port=8002, model_dir=None,
                 model_repository=MODEL_REPOSITORY, log_path=None, extra_env=None, installed_server=None,
                 drain_grace_s=DRAIN_GRACE_S, allocator="auto", host="127.0.0.1", admin_key=None):
        """host: the address the three endpoints listen on (0.0.0.0: every interface). admin_key: the control
        plane's key; default GLM_ADMIN_KEY, else a random one."""
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.model_dir, self.model_repository, self.log_path = model_dir, model_repository, log_path
        self.extra_env = extra_env or {}
        # (binary, backend directory) of an installed Triton (the NGC image); None: the one in nvidia-pytriton.
        self.installed_server = installed_server
        self.drain_grace_s = drain_grace_s
        self.allocator_library = allocator_library(allocator)
        self.host = host
        self.admin_key = admin_key or os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self._run_dir: str | None = None  # holds the drain file
        self._shm_regions: set[str] = set()  # the Python backend's shared-memory files this server has mapped

    @property
    def client_host(self) -> str:
        """Where this machine reaches the server."""
        return "localhost" if self.host in ("127.0.0.1", "0.0.0.0", "::") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def drain_file(self) -> str:
        return os.path.join(self._run_dir, "drain")

    def start(self) -> "TritonServer":
        if self.installed_server:
            binary, backend_dir = self.installed_server
        else:
            binary, backend_dir = os.path.join(pytriton_root(), "bin", "tritonserver"), prepare_backend_dir()
        self._run_dir = tempfile.mkdtemp(prefix="glm-server-")
        env = {**server_env(self.model_dir, bundled=not self.installed_server), DRAIN_FILE_ENV: self.drain_file}
        if self.allocator_library:
            env["LD_PRELOAD"] = os.pathsep.join(p for p in (self.allocator_library, env.get("LD_PRELOAD")) if p)
        command = [binary, *server_args(self.http_port, self.grpc_port, self.metrics_port, self.model_repository,
                                        backend_dir, self.admin_key, self.host)]
        output = open(self.log_path, "w") if self.log_path else None
        stack_limit = server_stack_limit()

        def before_exec() -> None:  # in the child: system calls only (the parent may have other threads)
            stop_with_parent()
            if stack_limit:
                resource.setrlimit(resource.RLIMIT_STACK, stack_limit)

        # A session of its own, so stopping it also stops the Python stub processes it started.
        self.process = subprocess.Popen(command, env={**env, **self.extra_env},
                                        stdout=output, stderr=subprocess.STDOUT if output else None,
                                        start_new_session=True, preexec_fn=before_exec)
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
                self.shm_regions()
                return
            time.sleep(0.1)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s")

    def stub_processes(self) -> dict[int, Stub]:
        return stub_processes(self.process.pid)

    def resident_mb(self) -> float:
        """Resident memory of tritonserver and its stubs together, in MiB."""
        return sum(resident_mb(pid) or 0.0 for pid in [self.process.pid, *self.stub_processes()])

    def shm_regions(self) -> set[str]:
        """The shared-memory regions the server has mapped so far (adding those mapped now): kill() removes any that
        are left behind."""
        self._shm_regions |= mapped_shm_regions(self.process.pid)
        return set(self._shm_regions)

    def repository(self, path: str = "index", body: dict | None = None, timeout_s: float = 120.0) -> list | None:
        """POST /v2/repository/<path> with the admin key: the index (each model's state), or a load or unload;
        None if the server does not answer within timeout_s."""
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/{path}",
                                         data=json.dumps(body or {}).encode(), method="POST",
                                         headers={ADMIN_KEY_HEADER: self.admin_key})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                reply = response.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return json.loads(reply) if reply else []

    def reload_model(self, name: str) -> bool:
        """Load the model anew from its own config (Triton skips a plain load of an unchanged model): a new stub
        process is ready before the old one is unloaded, so requests go on. Whether the load succeeded."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{name}/config", timeout=10) as response:
                config = response.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
        return self.repository(f"models/{name}/load", {"parameters": {"config": config}}) is not None

    def metric_totals(self, names: tuple[str, ...]) -> dict[str, float] | None:
        """Each of these metrics from the metrics endpoint, summed over its labels; None if it cannot be read."""
        try:
            with urllib.request.urlopen(f"http://{self.client_host}:{self.metrics_port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        totals = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
        return totals

    def engine_requests(self) -> int | None:
        """Requests running or waiting in the glm engines; None if the metrics cannot be read."""
        totals = self.metric_totals(("glm_num_requests_running", "glm_num_requests_waiting"))
        return None if totals is None else int(sum(totals.values()))

    def drain(self) -> None:
        """Ask the engines to drain (glm_engine.watchdog) and wait until they hold no request: those still running
        after drain_grace_s end with a retryable error."""
        self.shm_regions()
        with open(self.drain_file, "w") as f:
            f.write(f"{self.drain_grace_s:g}")
        deadline = time.monotonic() + self.drain_grace_s + 5  # the watchdog's poll, the last step, the metrics
        while time.monotonic() < deadline and self.process.poll() is None:
            if not self.engine_requests():  # 0, or metrics unreadable
                return
            time.sleep(0.2)

    def unload_models(self, timeout: float = EXIT_TIMEOUT_S) -> None:
        """Unload every model and wait until none is left: their finalize runs, their stub processes exit and remove
        their shared memory. (Triton's own shutdown first waits up to its exit timeout for clients to close idle
        HTTP connections, and then has no time left to unload anything.) A model that a request still holds (one
        Triton never ends, as its ensemble once did: docs/operations.md#disconnects) is given up on after `timeout`;
        kill() removes what its stub leaves."""
        index = self.repository() or []
        for entry in index:
            self.repository(f"models/{entry['name']}/unload")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            index = self.repository()
            if index is None or all(entry.get("state") not in ("READY", "UNLOADING", "LOADING") for entry in index):
                return
            time.sleep(0.2)

    def stop(self) -> None:
        """Drain, unload the models, then SIGTERM; a server that is left waiting only for idle client connections
        is killed a second later, as nothing of it needs cleaning up any more."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.drain()
            self.unload_models()
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server and its stubs at once (a server that has failed), then remove what they left."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        for region in self._shm_regions:  # a stub that did not finalize leaves its region behind
            try:
                os.unlink(region)
            except FileNotFoundError:
                pass
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class Stub(NamedTuple):
    """A Python stub process: which model, which version of it, which instance (e.g. "glm", "2", "glm_0_0")."""

    model: str
    version: str
    instance: str


def live_processes(wanted) -> dict[int, tuple[str, list[str]]]:
    """pid -> (name, argv) of the live processes for which wanted(pid, name) holds. Those that exit meanwhile, and the
    dead ones not yet reaped (zombies, which have no command line), are left out; wanted may read /proc itself."""
    found = {}
    for proc in glob.glob("/proc/[0-9]*"):
        pid = int(proc[6:])
        try:
            with open(f"{proc}/comm") as f:
                name = f.read().strip()
            if not wanted(pid, name):
                continue
            with open(f"{proc}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError):  # it exited meanwhile
            continue
        if command:
            found[pid] = (name, command.decode(errors="replace").split("\0"))
    return found


def stub_processes(server_pid: int) -> dict[int, Stub]:
    """The live Python stub processes of the server `server_pid` (the leader of their process group), by pid, from
    the command line Triton gives each: the model's <repository>/<model>/<version>/model.py, then the instance."""
    stubs = {}
    in_group = live_processes(lambda pid, name: name == STUB_NAME and os.getpgid(pid) == server_pid)
    for pid, (_, argv) in in_group.items():
        version_dir = os.path.dirname(argv[1])
        model = os.path.basename(os.path.dirname(version_dir))
        instance = next((arg for arg in argv[2:] if arg.startswith(model + "_")), model)
        stubs[pid] = Stub(model, os.path.basename(version_dir), instance)
    return stubs


def resident_mb(pid: int) -> float | None:
    """A process's resident memory (VmRSS) in MiB; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def mapped_shm_regions(pid: int | str) -> set[str]:
    """The Python backend's shared-memory files that process `pid` maps ({} if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split()[-1] for line in f if "/dev/shm/triton_python" in line}
    except OSError:
        return set()


def remove_stale_shm_regions(min_age_s: float = 60.0) -> None:
    """Remove the Python backend's shared-memory files that no process maps any more (a server killed before this
    launcher could clean up after it); young ones may belong to a server that is starting."""
    mapped = set().union(*(mapped_shm_regions(proc[6:]) for proc in glob.glob("/proc/[0-9]*")))
    for region in glob.glob(SHM_PATTERN):
        try:
            if region not in mapped and time.time() - os.stat(region).st_mtime > min_age_s:
                os.unlink(region)
        except OSError:  # another user's, or gone meanwhile
            continue
