#!/usr/bin/env python3
"""Start-up and stop: how long the server takes to become ready and to stop, and the memory of each of its processes.

Each round starts tritonserver through the launcher (as serve.sh, compose and Kubernetes do) on free ports, times it
until /v2/health/ready answers 200, records each process's resident memory and whether it has loaded torch, sends
one request through the ensemble, then times stop() (drain, unload every model, exit). A new server after a crash
([operations](../docs/operations.md#crashes)) and every version a rollout loads go through the same start.

    .venv/bin/python scripts/bench_startup.py --rounds 5 --json startup.json
    .venv/bin/python scripts/bench_startup.py --rounds 3 --baseline 8e890de    # alternating with that commit's tree

With --baseline, each round also starts the server of a git commit's tree (its launcher, model repository and
backend; the same checkpoint), the two in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import requests

from glm_tools.launcher import DEMO_CHECKPOINT, TritonServer, free_port, resident_mb

MEASURES = ("ready_s", "stop_s", "resident_mb")


def loaded_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()


def one_round(model_dir: str | None, work_dir: str) -> dict:
    server = TritonServer(free_port(), free_port(), free_port(), model_dir=model_dir,
                          log_path=os.path.join(work_dir, "tritonserver.log"))
    started = time.perf_counter()
    server.start()
    try:
        server.wait_ready()
        ready_s = time.perf_counter() - started
        processes = [{"model": "tritonserver", "rss_mb": resident_mb(server.process.pid), "torch": False}]
        for pid, stub in sorted(server.stub_processes().items(), key=lambda item: item[1]):
            processes.append({"model": stub.model, "rss_mb": resident_mb(pid), "torch": loaded_torch(pid)})
        answer = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", timeout=60,
                               json={"text_input": "def main(", "max_tokens": 8})
        answer.raise_for_status()
    finally:
        stopping = time.perf_counter()
        server.stop()
    return {"ready_s": ready_s, "stop_s": time.perf_counter() - stopping, "processes": processes,
            "resident_mb": sum(p["rss_mb"] or 0 for p in processes),
            "processes_with_torch": sum(p["torch"] for p in processes)}


def baseline_round(tree: str, model_dir: str) -> dict:
    """one_round() by this script in a process that imports the launcher of `tree` (tree_at)."""
    with tempfile.TemporaryDirectory() as work_dir:
        out = os.path.join(work_dir, "round.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--rounds", "1", "--model-dir", model_dir,
                        "--json", out], env={**os.environ, "PYTHONPATH": tree}, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["rounds"][0]


def describe(row: dict) -> str:
    return (f"ready in {row['ready_s']:.2f} s, stopped in {row['stop_s']:.2f} s, {row['resident_mb']:.0f} MiB "
            f"resident in {len(row['processes'])} processes, {row['processes_with_torch']} with torch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", help="the checkpoint to serve (default: config.pbtxt's, the demo model)")
    parser.add_argument("--baseline", help="a git commit whose tree's server to start in turn with this one's")
    parser.add_argument("--json", help="write the rounds and their medians here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # The baseline's model repository names the checkpoint by a path relative to itself: both get this one.
    model_dir = args.model_dir or (DEMO_CHECKPOINT if args.baseline else None)
    tree = None
    if args.baseline:
        # Here only: the baseline's rounds run this script over the baseline's glm_tools, which may predate tree_at.
        from glm_tools.engine_versions import tree_at
        tree = tree_at(args.baseline)

    rounds = {"current": [], **({"baseline": []} if tree else {})}
    for index in range(args.rounds):
        rounds["current"].append(one_round(model_dir, tempfile.mkdtemp(prefix="bench-startup-")))
        if tree:
            rounds["baseline"].append(baseline_round(tree, model_dir))
        for name, rows in rounds.items():
            print(f"[startup] round {index + 1} of {args.rounds}, {name}: {describe(rows[-1])}", flush=True)
    summary = {name: {key: statistics.median(row[key] for row in rows) for key in MEASURES}
               for name, rows in rounds.items()}
    for name, medians in summary.items():
        print(f"[startup] {name}, medians of {args.rounds}: ready in {medians['ready_s']:.2f} s, stopped in "
              f"{medians['stop_s']:.2f} s, {medians['resident_mb']:.0f} MiB resident")
    if tree:
        summary["ready_speedup"] = summary["baseline"]["ready_s"] / summary["current"]["ready_s"]
        print(f"[startup] ready {summary['ready_speedup']:.2f}x sooner than {args.baseline}")
    print("| process | resident MiB (last round) | torch |\n|---|---:|---|")
    for process in rounds["current"][-1]["processes"]:
        print(f"| {process['model']} | {process['rss_mb']:.0f} | {'yes' if process['torch'] else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": args.baseline, "summary": summary, "rounds": rounds["current"],
                       "baseline_rounds": rounds.get("baseline", [])}, f, indent=2)
        print(f"[startup] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
