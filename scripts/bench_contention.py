#!/usr/bin/env python3
"""The engine offline, alone and while another process takes a share of the CPU in short bursts, as Triton's server,
its other models and (on a machine that runs them) the clients do: what each CPU-second taken from the engine costs.

    .venv/bin/python scripts/bench_contention.py [--busy-ms 0.3] [--period-ms 1] [--rounds 2]
                                                 [--quantization none,int8] [--num-requests 32] [--json F]

Rounds alternate a quiet run and a contended one of scripts/bench_engine.py's offline workload on its benchmark
model. The competitor is a process that busy-waits --busy-ms every --period-ms. For each run it prints output
tokens/s, the competitor's measured share of the machine (its CPU seconds over the run's seconds times the cores),
and the contended rate against what that share alone would leave (quiet rate x (1 - share)): an engine whose
threads never wait for one another would lose no more than the share; one whose parallel regions end at a barrier
loses more, as every region waits for a thread the scheduler took away. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench_engine import bench_engine_offline, process_cpu_seconds, workload
from glm_engine.config import ModelConfig
from glm_tools.demo_model import BENCH_ARCHITECTURE, build_demo_model

CORES = len(os.sched_getaffinity(0))
COMPETITOR = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(max(period - busy, 0.0))
"""


def contended_run(model_dir: str, requests, quantization: str, busy_ms: float, period_ms: float) -> dict:
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(busy_ms), str(period_ms)])
    try:
        time.sleep(0.3)  # past the competitor's interpreter start-up, which is not the load measured
        before = process_cpu_seconds(competitor.pid)
        result = bench_engine_offline(model_dir, requests, quantization=quantization)
        taken = process_cpu_seconds(competitor.pid) - before
    finally:
        competitor.kill()
        competitor.wait()
    return {**result, "competitor_cpu_s": taken,
            "competitor_share": taken / (result["seconds"] * CORES)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=0.3, help="the competitor's CPU time every period")
    parser.add_argument("--period-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", default="none,int8", help="comma-separated engine quantizations to run")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--model-dir", help="this checkpoint instead of the benchmark model")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not 0 < args.busy_ms <= args.period_ms:
        parser.error("--busy-ms must be positive and at most --period-ms")

    model_dir = args.model_dir or build_demo_model(os.path.join(tempfile.mkdtemp(), "glm-bench"),
                                                   architecture=BENCH_ARCHITECTURE)
    requests = workload(args.num_requests, vocab=ModelConfig.from_checkpoint(model_dir).vocab_size)
    quantizations = args.quantization.split(",")
    rows = []
    for index in range(args.rounds):
        for quantization in quantizations:
            quiet = bench_engine_offline(model_dir, requests, quantization=quantization)
            contended = contended_run(model_dir, requests, quantization, args.busy_ms, args.period_ms)
            row = {"round": index + 1, "quantization": quantization, "quiet_tokens_per_s": quiet["tokens_per_s"],
                   "contended_tokens_per_s": contended["tokens_per_s"],
                   "competitor_share": contended["competitor_share"],
                   "contended_vs_quiet": contended["tokens_per_s"] / quiet["tokens_per_s"],
                   "share_alone_would_leave": 1 - contended["competitor_share"],
                   "output_tokens": [quiet["output_tokens"], contended["output_tokens"]]}
            rows.append(row)
            print(f"[contention] round {row['round']} {quantization}: quiet {row['quiet_tokens_per_s']:.0f} tokens/s, "
                  f"contended {row['contended_tokens_per_s']:.0f} ({row['contended_vs_quiet']:.2f}x) with the "
                  f"competitor taking {row['competitor_share']:.1%} of the machine (that share alone would leave "
                  f"{row['share_alone_would_leave']:.2f}x)", flush=True)
    for quantization in quantizations:
        mine = [row for row in rows if row["quantization"] == quantization]
        print(f"{quantization}: contended / quiet, median {np.median([r['contended_vs_quiet'] for r in mine]):.2f}x, "
              f"against {np.median([r['share_alone_would_leave'] for r in mine]):.2f}x for the share alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"busy_ms": args.busy_ms, "period_ms": args.period_ms, "cores": CORES,
                       "requested_output_tokens": sum(n for _, n in requests), "rounds": rows}, f, indent=2)
        print(f"[contention] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
