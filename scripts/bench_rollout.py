#!/usr/bin/env python3
"""A version rollout under load, timed: deploy, canary, promote and rollback while clients stream through every
front, as docs/versions.md describes.

    .venv/bin/python scripts/bench_rollout.py [--model demo|bench] [--clients-per-kind 4] [--canary-percent 20]
                                              [--canary-seconds 20] [--json rollout.json]

It builds two versions of the demo model (or of the benchmarks' bigger one, --model bench) with one tokenizer and
different weights, starts tritonserver (through glm_tools/launcher.py) on a copy of the model repository, runs
4 x --clients-per-kind clients (the ensemble streaming over HTTP and gRPC, bls over HTTP and gRPC), and prints each
step's duration, the time from the canary command to the canary's first answer, the canary's measured share, the
requests that failed and the server's memory before the deploy and after the promote.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from glm_tools.client_load import ClientLoad
from glm_tools.demo_model import BENCH_ARCHITECTURE, build_demo_model
from glm_tools.launcher import TritonServer, free_port, model_repository_with
from glm_tools.versions import VersionManager


def rollout(work_dir: str, architecture: dict | None, per_kind: int, percent: float, canary_s: float) -> dict:
    stable = build_demo_model(os.path.join(work_dir, "v1"), architecture=architecture)
    candidate = build_demo_model(os.path.join(work_dir, "v2"), seed=1, architecture=architecture,
                                 tokenizer_from=stable)
    repository = model_repository_with({}, work_dir)
    log_path = os.path.join(work_dir, "tritonserver.log")
    with TritonServer(free_port(), free_port(), free_port(), model_dir=stable, log_path=log_path,
                      model_repository=repository) as server:
        server.wait_ready()
        versions = VersionManager(server.http_url, repository, admin_key=server.admin_key,
                                  metrics_url=f"localhost:{server.metrics_port}",
                                  out=lambda line: print(line, flush=True))
        marks = {}
        with ClientLoad(server.http_url, server.grpc_url, per_kind) as load:
            while load.count() < 4 * per_kind:
                time.sleep(0.2)
            memory_before = server.resident_mb()
            marks["deploy"] = time.monotonic()
            versions.deploy(2, candidate)
            marks["canary"] = time.monotonic()
            versions.canary(2, percent)
            time.sleep(canary_s)
            marks["promote"] = time.monotonic()
            versions.promote(2)
            memory_after = server.resident_mb()
            time.sleep(2)
            marks["rollback"] = time.monotonic()
            versions.rollback()
            marks["end"] = time.monotonic()
            time.sleep(2)
        results = load.results
        first_canary = min((r.ended for r in results if r.version == 2 and r.started >= marks["canary"]),
                           default=None)
        canary = load.finished_between(marks["canary"], marks["promote"])
    return {
        "steps": [{"command": command, "step": step, "seconds": round(seconds, 3)}
                  for command, step, seconds in versions.timings],
        "first_canary_answer_s": None if first_canary is None else round(first_canary - marks["canary"], 3),
        "canary_requests": len(canary),
        "canary_share_percent": round(100.0 * sum(r.version == 2 for r in canary) / max(len(canary), 1), 1),
        "requests": len(results),
        "failed": len(load.failed()),
        "failures": [f"{r.client}: {r.error or r.finish_reason}" for r in load.failed()[:10]],
        "memory_before_deploy_mib": round(memory_before),
        "memory_after_promote_mib": round(memory_after),
        "phase_s": {name: round(marks[after] - marks[name], 2) for name, after in
                    (("deploy", "canary"), ("canary", "promote"), ("promote", "rollback"), ("rollback", "end"))},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo", "bench"), default="demo")
    parser.add_argument("--clients-per-kind", type=int, default=4, help="clients of each of the 4 kinds (default 4)")
    parser.add_argument("--canary-percent", type=float, default=20.0)
    parser.add_argument("--canary-seconds", type=float, default=20.0, help="how long the canary runs")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work_dir:
        summary = rollout(work_dir, BENCH_ARCHITECTURE if args.model == "bench" else None, args.clients_per_kind,
                          args.canary_percent, args.canary_seconds)
    summary["model"] = args.model
    print(f"[rollout] {args.model}: {summary['requests']} requests, {summary['failed']} failed; first canary answer "
          f"{summary['first_canary_answer_s']} s after the canary command; canary share "
          f"{summary['canary_share_percent']}% of {summary['canary_requests']}; memory "
          f"{summary['memory_before_deploy_mib']} MiB before the deploy, {summary['memory_after_promote_mib']} MiB "
          "after the promote", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"[rollout] wrote {args.json}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
