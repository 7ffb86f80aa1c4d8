#!/usr/bin/env python3
"""Soak: a long Locust run against a server of its own, watching memory.

Every --interval seconds it samples the resident memory (RSS) of tritonserver and of each model's stub process, and
the engine's gauges (KV blocks, running and waiting requests, tokens generated), into soak.csv; at the end it
writes soak.png (RSS over time, one line per process) and soak.json: each process's RSS at the start of the second
half and at the end, and its growth over the second half in MB per hour, which tells whether it levels off.

    .venv/bin/python scripts/soak.py --minutes 30 --users 16 --out soak-results
    .venv/bin/python scripts/soak.py --minutes 30 --allocator jemalloc --out soak-jemalloc

--allocator picks the malloc of the server and its stubs (system, jemalloc or tcmalloc: Debian's libjemalloc2,
libtcmalloc-minimal4), as Triton's docs suggest for Python-backend deployments; auto, like the launcher, takes
jemalloc when it is installed. --user-classes runs some of the Locust users only (one front end at a time).
--reload-every N also reloads the glm model every N minutes (a model rollout), under the load. --compare DIR...
plots earlier runs side by side.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

from glm_tools.launcher import ALLOCATORS, REPO, TritonServer, allocator_library, free_port, resident_mb

USER_CLASSES = ("HttpGenerateUser", "HttpStreamUser", "GrpcStreamUser")
GAUGES = ("glm_kv_blocks_used", "glm_num_requests_running", "glm_num_requests_waiting",
          "glm_generation_tokens_total", "glm_requests_finished_total")


def sample(server: TritonServer, started: float) -> dict[str, float]:
    row = {"seconds": round(time.monotonic() - started, 1), "rss_mb tritonserver": resident_mb(server.process.pid)}
    for pid, stub in sorted(server.stub_processes().items(), key=lambda item: item[1]):
        key = f"rss_mb {stub.model}"
        row[key] = round(row.get(key, 0) + (resident_mb(pid) or 0), 1)
    gauges = server.metric_totals(GAUGES)
    if gauges is None:
        raise RuntimeError(f"the server's metrics at {server.client_host}:{server.metrics_port} cannot be read")
    row.update(gauges)
    return row


def growth(rows: list[dict], key: str) -> dict[str, float]:
    """RSS at the middle and at the end of the run, and the least-squares slope of the second half in MB/hour."""
    half = [(row["seconds"], row[key]) for row in rows[len(rows) // 2:] if row.get(key) is not None]
    if len(half) < 2:
        return {}
    n = len(half)
    mean_t = sum(t for t, _ in half) / n
    mean_y = sum(y for _, y in half) / n
    slope = (sum((t - mean_t) * (y - mean_y) for t, y in half) / max(1e-9, sum((t - mean_t) ** 2 for t, _ in half)))
    return {"middle_mb": round(half[0][1], 1), "end_mb": round(half[-1][1], 1),
            "second_half_mb_per_hour": round(slope * 3600, 1), "peak_mb": round(max(row[key] for row in rows
                                                                                     if row.get(key)), 1)}


def plot(rows: list[dict], keys: list[str], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(9, 4.5))
    minutes = [row["seconds"] / 60 for row in rows]
    for key in keys:
        axes.plot(minutes, [row.get(key) for row in rows], label=key.replace("rss_mb ", ""))
    axes.set_xlabel("minutes")
    axes.set_ylabel("RSS (MB)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def compare(directories: list[str], path: str) -> None:
    """One figure from earlier runs: glm's and tritonserver's RSS in each, labelled by its directory's name and its
    allocator."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.2))
    for directory in directories:
        with open(os.path.join(directory, "soak.json")) as f:
            label = f"{os.path.basename(os.path.normpath(directory))} ({os.path.basename(json.load(f)['allocator'])})"
        with open(os.path.join(directory, "soak.csv")) as f:
            rows = list(csv.DictReader(f))
        minutes = [float(row["seconds"]) / 60 for row in rows]
        for panel, process in zip(panels, ("glm", "tritonserver")):
            panel.plot(minutes, [float(row[f"rss_mb {process}"]) for row in rows], label=label)
    for panel, process in zip(panels, ("glm", "tritonserver")):
        panel.set_title(f"{process} RSS (MB)")
        panel.set_xlabel("minutes")
        panel.grid(alpha=0.3)
        panel.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"[soak] wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--interval", type=float, default=10, help="seconds between samples")
    parser.add_argument("--allocator", choices=("auto", *ALLOCATORS, "system"), default="auto",
                        help="as the launcher's --allocator (auto: jemalloc if installed)")
    parser.add_argument("--user-classes", nargs="+", default=list(USER_CLASSES), choices=USER_CLASSES,
                        help="the Locust users to run (default: all three), e.g. one alone to soak one front end")
    parser.add_argument("--reload-every", type=float, default=0, help="reload glm every this many minutes (0: never)")
    parser.add_argument("--model-dir", default=os.path.join(REPO, "checkpoints", "glm-demo"))
    parser.add_argument("--out", default="soak-results")
    parser.add_argument("--compare", nargs="+", metavar="DIR",
                        help="run nothing: plot glm's and tritonserver's RSS of these earlier runs into "
                             "OUT/soak-compare.png")
    args = parser.parse_args()
    if args.compare:
        os.makedirs(args.out, exist_ok=True)
        compare(args.compare, os.path.join(args.out, "soak-compare.png"))
        return 0

    try:
        allocator = allocator_library(args.allocator) or "system malloc"
    except FileNotFoundError as exc:
        sys.exit(str(exc))
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "tritonserver.log")
    rows: list[dict] = []
    with TritonServer(free_port(), free_port(), free_port(), model_dir=args.model_dir, log_path=log_path,
                      extra_env={"OMP_NUM_THREADS": "2"}, allocator=args.allocator) as server:
        server.wait_ready()
        print(f"[soak] server ready ({allocator}); {args.users} users for {args.minutes:g} min",
              flush=True)
        locust = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "loadtests", "run.py"), "--host", f"http://{server.http_url}",
             "--grpc-url", server.grpc_url, "--users", str(args.users), "--run-time", f"{int(args.minutes * 60)}s",
             "--user-class", *args.user_classes, "--label", args.allocator,
             "--out", os.path.join(args.out, "locust")],
            stdout=open(os.path.join(args.out, "locust.log"), "w"), stderr=subprocess.STDOUT)
        started = time.monotonic()
        next_reload = args.reload_every * 60 or float("inf")
        try:
            while locust.poll() is None:
                rows.append(sample(server, started))
                last = rows[-1]
                print(f"[soak] {last['seconds'] / 60:5.1f} min  tritonserver {last['rss_mb tritonserver']:.0f} MB  "
                      f"glm {last.get('rss_mb glm', 0):.0f} MB  tokens {last['glm_generation_tokens_total']:.0f}",
                      flush=True)
                if last["seconds"] >= next_reload:
                    server.reload_model("glm")
                    next_reload += args.reload_every * 60
                time.sleep(args.interval)
        finally:
            if locust.poll() is None:
                locust.terminate()
            locust.wait()
    keys = sorted({key for row in rows for key in row if key.startswith("rss_mb")})
    with open(os.path.join(args.out, "soak.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["seconds", *keys, *GAUGES])
        writer.writeheader()
        writer.writerows(rows)
    summary = {"allocator": allocator, "users": args.users, "user_classes": args.user_classes, "minutes": args.minutes,
               "reload_every_minutes": args.reload_every, "samples": len(rows),
               "tokens": rows[-1]["glm_generation_tokens_total"] if rows else 0,
               "requests": rows[-1]["glm_requests_finished_total"] if rows else 0,
               "rss": {key.replace("rss_mb ", ""): growth(rows, key) for key in keys}}
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(rows, keys, os.path.join(args.out, "soak.png"),
         f"RSS under {args.users} Locust users, {os.path.basename(allocator)}")
    print(json.dumps(summary, indent=1))
    print(f"[soak] wrote {args.out}/soak.csv, soak.json, soak.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
