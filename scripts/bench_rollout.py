#!/usr/bin/env python3
"""A version rollout under load, timed: deploy, canary, promote and rollback while clients stream through every
front, as docs/versions.md describes.

    .venv/bin/python scripts/bench_rollout.py [--model demo|bench] [--clients-per-kind 4] [--canary-percent 20]
                                              [--canary-seconds 20] [--json rollout.json]
    .venv/bin/python scripts/bench_rollout.py --forwarding [--rounds 6] [--model demo|bench] [--json forwarding.json]

It builds two versions of the demo model (or of the benchmarks' bigger one, --model bench) with one tokenizer and
different weights, starts tritonserver (through glm_tools/launcher.py) on a copy of the model repository, runs
4 x --clients-per-kind clients (the ensemble streaming over HTTP and gRPC, bls over HTTP and gRPC), and prints each
step's duration, the time from the canary command to the canary's first answer, the canary's measured share, the
requests that failed and the server's memory before the deploy and after the promote.

--forwarding measures instead what a forwarded request costs: with both versions loaded and no other load, the same
streams through the ensemble (48 tokens each), in alternating rounds, served by version 2 directly and forwarded by
version 2 to version 1 (the split's stable version): median time to first token and to the last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import requests

from glm_tools.client_load import ClientLoad
from glm_tools.demo_model import BENCH_ARCHITECTURE, build_demo_model
from glm_tools.launcher import TritonServer, free_port, model_repository_with
from glm_tools.versions import VersionManager
from triton_glm.versions import Traffic, write_traffic


def two_versions(work_dir: str, architecture: dict | None) -> tuple[str, str, str]:
    """(version 1's checkpoint, version 2's, a copy of the model repository): one tokenizer, other weights."""
    stable = build_demo_model(os.path.join(work_dir, "v1"), architecture=architecture)
    candidate = build_demo_model(os.path.join(work_dir, "v2"), seed=1, architecture=architecture,
                                 tokenizer_from=stable)
    return stable, candidate, model_repository_with({}, work_dir)


@contextlib.contextmanager
def running_server(work_dir: str, stable: str, repository: str):
    """(server, its VersionManager), serving `stable` as version 1; stopped at the end."""
    with TritonServer(free_port(), free_port(), free_port(), model_dir=stable, model_repository=repository,
                      log_path=os.path.join(work_dir, "tritonserver.log")) as server:
        server.wait_ready()
        yield server, VersionManager(server.http_url, repository, admin_key=server.admin_key,
                                     metrics_url=f"localhost:{server.metrics_port}",
                                     out=lambda line: print(line, flush=True))


def timed_stream(server: TritonServer) -> tuple[float, float, int]:
    """(seconds to the first event, to the last, the version that answered) of one 48-token ensemble stream."""
    started, first, version = time.perf_counter(), None, None
    with requests.post(f"http://{server.http_url}/v2/models/ensemble/generate_stream", stream=True, timeout=120,
                       json={"text_input": "measure", "max_tokens": 48, "ignore_eos": True, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith(b"data: "):
                first = first or time.perf_counter() - started
                version = json.loads(line[6:])["glm_version"]
    return first, time.perf_counter() - started, version


def forwarding(work_dir: str, architecture: dict | None, rounds: int) -> dict:
    stable, candidate, repository = two_versions(work_dir, architecture)
    with running_server(work_dir, stable, repository) as (server, versions):
        versions.deploy(2, candidate)
        model_path = os.path.join(repository, "glm")
        ways = {"direct": Traffic(stable=2), "forwarded": Traffic(stable=1, canary=2, canary_percent=0.0)}
        times: dict[str, list] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, traffic in ways.items():
                write_traffic(model_path, traffic)  # Triton gives every stream to version 2, the newest
                timed_stream(server)  # a warm-up after the switch
                times[name] += [timed_stream(server) for _ in range(8)]
    summary = {}
    for name, rows in times.items():
        summary[name] = {"streams": len(rows), "served_by": sorted({row[2] for row in rows}),
                         "ttft_ms_p50": round(1000 * statistics.median(row[0] for row in rows), 2),
                         "stream_ms_p50": round(1000 * statistics.median(row[1] for row in rows), 2)}
        print(f"[forwarding] {name:>9}: served by version {summary[name]['served_by']}, TTFT P50 "
              f"{summary[name]['ttft_ms_p50']} ms, whole stream P50 {summary[name]['stream_ms_p50']} ms "
              f"({len(rows)} streams)", flush=True)
    return summary


def rollout(work_dir: str, architecture: dict | None, per_kind: int, percent: float, canary_s: float) -> dict:
    stable, candidate, repository = two_versions(work_dir, architecture)
    with running_server(work_dir, stable, repository) as (server, versions):
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
    parser.add_argument("--forwarding", action="store_true", help="measure a forwarded request's cost instead")
    parser.add_argument("--rounds", type=int, default=6, help="--forwarding: rounds of 8 streams each way")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    architecture = BENCH_ARCHITECTURE if args.model == "bench" else None
    if args.forwarding:
        with tempfile.TemporaryDirectory() as work_dir:
            summary = {"model": args.model, **forwarding(work_dir, architecture, args.rounds)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        return 0
    with tempfile.TemporaryDirectory() as work_dir:
        summary = rollout(work_dir, architecture, args.clients_per_kind, args.canary_percent, args.canary_seconds)
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
