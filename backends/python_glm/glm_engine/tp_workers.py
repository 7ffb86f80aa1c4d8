"""The processes of a tensor-parallel engine: rank 0 is the engine's own process (it schedules and samples); each
other rank is a worker process started here, holding its part of the model and running the steps rank 0 sends.

Rank 0 (WorkerGroup.start) starts one `python -m glm_engine.tp_worker_main` per extra rank, waits for each to say it is
up (while watching that it has not died: a worker that fails to start is an error naming its exit status, never a
hang), and joins them in a process group: NCCL on CUDA, gloo on the CPU, plus a gloo group for control messages.
Then every rank loads its shard. A worker loops: receive a StepInputs, run it; None means stop.

Failure: a worker that dies is seen by fault() (the engine's watchdog ends the model's process, which the launcher
restarts: docs/operations.md), and by rank 0's next collective with it (gloo reports a closed connection at once).
A worker whose rank 0 has died exits: its next receive fails, and a thread watches its parent in case it waits for
ever in a collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist

from .config import EngineConfig
from .model_runner import resolve_device
from .tensor_parallel import Shard, connect

log = logging.getLogger(__name__)

# How long workers get to start (import torch, reach the rendezvous); loading weights comes after, without a limit.
START_TIMEOUT_S = 120.0
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_executable() -> str:
    """The interpreter for the workers. In Triton's Python stub, sys.executable is the stub, not Python: there the
    first python3 on PATH, whose environment the stub's code sees too (docs/operations.md)."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3") or shutil.which("python") or sys.executable


def backend_for(config: EngineConfig) -> str:
    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


class WorkerGroup:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, processes: list[subprocess.Popen], shard: Shard, store_dir: str):
        self.processes, self.shard, self.store_dir = processes, shard, store_dir
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig) -> "WorkerGroup":
        world_size = config.tensor_parallel_size
        store_dir = tempfile.mkdtemp(prefix="glm-tp-")
        store_path = os.path.join(store_dir, "store")
        backend = backend_for(config)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank runs on this machine
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        processes = []
        try:
            for rank in range(1, world_size):
                processes.append(subprocess.Popen(
                    [python_executable(), "-m", "glm_engine.tp_worker_main", "--rank", str(rank), "--world-size",
                     str(world_size), "--store", store_path, "--backend", backend, "--parent", str(os.getpid()),
                     "--config", json.dumps(dataclasses.asdict(config))],
                    stdin=subprocess.DEVNULL, env=env))
            store = dist.FileStore(store_path, world_size)
            _wait_until_up(store, processes)
            shard = connect(0, world_size, store, backend)
        except BaseException:
            for process in processes:
                process.kill()
                process.wait()
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        log.info("tensor parallelism: %d ranks over %s, workers %s", world_size, backend,
                 [process.pid for process in processes])
        return cls(processes, shard, store_dir)

    def fault(self) -> str | None:
        """Why the group can no longer run (a worker has exited), or None."""
        if self._closed:
            return None
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with status {process.returncode}"
        return None

    def close(self, timeout_s: float = 10.0, kill: bool = False) -> None:
        """Tell the workers to stop, wait for them (killing those that do not), and leave the process group.
        kill: kill them at once (rank 0 failed while they may be in the middle of something)."""
        if self._closed:
            return
        self._closed = True
        if kill:
            timeout_s = 0.0
        elif all(process.poll() is None for process in self.processes):
            try:
                self.shard.broadcast(None)
            except RuntimeError:  # a worker went meanwhile: the others are killed below
                pass
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        dist.destroy_process_group()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def _wait_until_up(store: dist.Store, processes: list[subprocess.Popen]) -> None:
    """Until every worker has written its key in the store; a worker that exits first is an error saying so."""
    keys = [f"up/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status {process.returncode} while "
                                   "starting (its error is in the server's log)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
