#!/usr/bin/env python3
"""A burst of concurrent requests against the engine's admission limit: how fast the excess is refused, and what
latency the admitted requests see.

    .venv/bin/python scripts/bench_burst.py [--requests 300] [--max-tokens 64] [--json burst.json]
                                            [--max-num-seqs 64] [--max-waiting-requests 128] [--model-dir DIR]

It starts tritonserver (through glm_tools/launcher.py) on a copy of the model repository with the given engine
limits, sends every request at once to the ensemble's generate endpoint, each for --max-tokens tokens, and prints
the count, P50/P99/max seconds of the refused and of the served requests, side by side with the same burst against
a server without an admission limit (--max-waiting-requests 0) unless --no-baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

from glm_tools.demo_model import build_demo_model
from glm_tools.launcher import TritonServer, free_port, model_repository_with


def one_request(server: TritonServer, index: int, max_tokens: int) -> tuple[str, float]:
    """("served", "refused" or the error, seconds) of one request to the ensemble's generate endpoint."""
    started = time.perf_counter()
    response = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", timeout=3600,
                             json={"text_input": f"burst request {index}", "max_tokens": max_tokens,
                                   "ignore_eos": True})
    seconds = time.perf_counter() - started
    if response.status_code == 200:
        return "served", seconds
    # Triton 2.51's generate endpoint answers every error with 400: the message tells an overload.
    error = response.json().get("error", response.text)
    return ("refused" if "the server is overloaded" in error else error[:200]), seconds


def burst(model_dir: str, parameters: dict[str, str], requests: int, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as work_dir:
        repository = model_repository_with(parameters, work_dir)
        log_path = os.path.join(work_dir, "tritonserver.log")
        with TritonServer(free_port(), free_port(), free_port(), model_dir=model_dir, log_path=log_path,
                          model_repository=repository) as server:
            server.wait_ready()
            one_request(server, 0, 2)  # warm-up
            started = time.perf_counter()
            with ThreadPoolExecutor(requests) as pool:
                results = list(pool.map(lambda index: one_request(server, index, max_tokens), range(requests)))
            wall = time.perf_counter() - started
    summary = {"parameters": parameters, "requests": requests, "max_tokens": max_tokens, "wall_s": wall}
    for kind in ("served", "refused"):
        seconds = sorted(s for status, s in results if status == kind)
        summary[kind] = {"count": len(seconds)}
        if seconds:
            summary[kind].update(p50_s=float(np.percentile(seconds, 50)), p99_s=float(np.percentile(seconds, 99)),
                                 max_s=seconds[-1])
    summary["other_errors"] = sorted({status for status, _ in results} - {"served", "refused"})
    return summary


def describe(name: str, summary: dict) -> str:
    def figures(kind):
        row = summary[kind]
        if not row["count"]:
            return f"{kind} 0"
        return f"{kind} {row['count']}: P50 {row['p50_s']:.3f} s, P99 {row['p99_s']:.3f} s, max {row['max_s']:.3f} s"

    return f"{name:<22} {figures('served')}; {figures('refused')}; wall {summary['wall_s']:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", default="64")
    parser.add_argument("--max-waiting-requests", default="128")
    parser.add_argument("--no-baseline", action="store_true", help="skip the burst without an admission limit")
    parser.add_argument("--model-dir", help="default: build the demo model")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or build_demo_model(os.path.join(tempfile.mkdtemp(), "glm-demo"))

    runs = {"admission limit": {"max_num_seqs": args.max_num_seqs, "max_waiting_requests": args.max_waiting_requests}}
    if not args.no_baseline:
        runs["no admission limit"] = {"max_num_seqs": args.max_num_seqs, "max_waiting_requests": "0"}
    results = {}
    for name, parameters in runs.items():
        print(f"[burst] {args.requests} requests of {args.max_tokens} tokens, {parameters}...", flush=True)
        results[name] = burst(model_dir, parameters, args.requests, args.max_tokens)
        print(describe(name, results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"[burst] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
