#!/usr/bin/env python3
"""Headless Locust runs against a running server: one run per number of users, each writing Locust's CSV and
HTML report; then a summary JSON (requests/s, output tokens/s, P50/P95/P99 of latency, TTFT and ITL, failures,
requests refused as overloaded) and a PNG plot of latency and throughput against users, one line per label (use --compare to add the summary of
an earlier run, e.g. with another max_queue_delay_microseconds or instance count).

    python loadtests/run.py --users 1,8,32 --run-time 60s --user-class HttpStreamUser --out loadtests/results
"""

from __future__ import annotations

import argparse
import csv
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

from loadtests.prompts import FINAL_STATS, OVERLOADED, REQUEST_NAMES

HERE = os.path.dirname(os.path.abspath(__file__))

USER_CLASSES = ("HttpGenerateUser", "HttpStreamUser", "GrpcStreamUser", "OpenAiChatUser")
EXIT_GRACE_S = 30
PERCENTILES = {"p50": "50%", "p95": "95%", "p99": "99%"}


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except socket.gaierror:
        return False


def locust_run(args: argparse.Namespace, users: int, prefix: str) -> float:
    """One headless Locust run; returns its wall time."""
    command = [sys.executable, "-m", "locust", "-f", os.path.join(HERE, "locustfile.py"), "--headless",
               "--host", args.host, "--grpc-url", args.grpc_url, "--openai-url", args.openai_url,
               "--openai-api-key", args.openai_api_key, "-u", str(users),
               "-r", str(args.spawn_rate or users), "-t", args.run_time, "--stop-timeout", str(args.stop_timeout),
               "--csv", prefix, "--html", prefix + ".html", "--only-summary", "--loglevel", "WARNING",
               "--prompt-words", args.prompt_words, "--output-tokens", args.output_tokens,
               "--scenario", args.scenario, "--seed", str(args.seed), "--max-requests", str(args.max_requests),
               "--temperature", str(args.temperature), "--top-p", str(args.top_p),
               *args.user_class]
    print(f"[loadtest] {args.label}: {users} user(s) of {', '.join(args.user_class)} for {args.run_time}...",
          flush=True)
    started = time.monotonic()
    # Locust has been seen, rarely, not to exit once its reports were written (hundreds of gRPC streams under
    # gevent): past its run time, stop timeout and a grace period, it is stopped, and its reports are used if whole.
    limit = duration_s(args.run_time) + args.stop_timeout + EXIT_GRACE_S
    try:
        completed = subprocess.run(command, cwd=HERE, text=True, capture_output=True, timeout=limit)
    except subprocess.TimeoutExpired:
        if not os.path.exists(prefix + ".html"):  # the HTML report is written last (after FINAL_STATS)
            raise SystemExit(f"locust did not finish within {limit:.0f} s") from None
        print(f"[loadtest] locust did not exit {EXIT_GRACE_S} s after its run; stopped it (its reports are whole)",
              file=sys.stderr, flush=True)
        return time.monotonic() - started
    # Locust exits 1 when a request failed; the summary reports failures, so that is not an error here.
    if completed.returncode not in (0, 1) or not os.path.exists(prefix + FINAL_STATS):
        sys.stderr.write(completed.stdout[-3000:] + completed.stderr[-3000:])
        raise SystemExit(f"locust failed (exit {completed.returncode})")
    return time.monotonic() - started


def duration_s(text: str) -> float:
    """Locust's run-time syntax (90, 40s, 2m, 1h30m) in seconds."""
    if text.isdigit():
        return float(text)
    parts = re.findall(r"(\d+)\s*([hms])", text)
    if not parts:
        raise SystemExit(f"--run-time: cannot read {text!r} (e.g. 40s, 2m, 1h30m)")
    return float(sum(int(number) * {"h": 3600, "m": 60, "s": 1}[unit] for number, unit in parts))


def summarize(prefix: str, users: int, label: str, wall_s: float) -> dict:
    """The summary of one run, from its totals in <prefix> + FINAL_STATS (Locust's CSV columns; times in
    milliseconds)."""
    with open(prefix + FINAL_STATS, newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}

    def percentiles(names: list[str]) -> dict[str, float] | None:
        present = [rows[n] for n in names if n in rows and int(rows[n]["Request Count"])]
        if not present:
            return None
        # With several request kinds in one run, report the busiest one's percentiles.
        row = max(present, key=lambda r: int(r["Request Count"]))
        return {key: float(row[column]) for key, column in PERCENTILES.items()}

    requests = [rows[n] for n in REQUEST_NAMES if n in rows]
    count = sum(int(r["Request Count"]) for r in requests)
    return {
        "label": label, "users": users, "wall_s": round(wall_s, 1), "requests": count,
        "failures": sum(int(r["Failure Count"]) for r in rows.values() if r["Name"] != "Aggregated"),
        "overloaded": sum(int(rows[name + OVERLOADED]["Request Count"])
                          for name in REQUEST_NAMES if name + OVERLOADED in rows),
        "requests_per_s": round(sum(float(r["Requests/s"]) for r in requests), 3),
        "output_tokens_per_s": round(sum(float(r["Requests/s"]) * float(r["Average Content Size"])
                                         for r in requests), 1),
        "latency_ms": percentiles(list(REQUEST_NAMES)),
        "ttft_ms": percentiles([n + " TTFT" for n in REQUEST_NAMES]),
        "itl_ms": percentiles([n + " ITL" for n in REQUEST_NAMES]),
        "report": os.path.basename(prefix) + ".html",
        "entries": {name: {"requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
                           **{key: float(row[column]) for key, column in PERCENTILES.items()}}
                    for name, row in rows.items() if name != "Aggregated"},
    }


def print_table(runs: list[dict]) -> None:
    def p(summary, key):
        values = summary[key]
        return "-" if values is None else f"{values['p50']:.0f}/{values['p95']:.0f}/{values['p99']:.0f}"

    print(f"{'label':<16}{'users':>6}{'reqs':>7}{'fail':>6}{'503':>6}{'req/s':>8}{'tok/s':>8}"
          f"  {'latency ms P50/95/99':<22}{'TTFT ms P50/95/99':<20}{'ITL ms P50/95/99':<18}")
    for s in runs:
        print(f"{s['label']:<16}{s['users']:>6}{s['requests']:>7}{s['failures']:>6}{s.get('overloaded', 0):>6}"
              f"{s['requests_per_s']:>8.2f}"
              f"{s['output_tokens_per_s']:>8.1f}  {p(s, 'latency_ms'):<22}{p(s, 'ttft_ms'):<20}{p(s, 'itl_ms'):<18}")


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency_axis, ttft_axis, throughput_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    for label in dict.fromkeys(s["label"] for s in runs):
        series = sorted((s for s in runs if s["label"] == label), key=lambda s: s["users"])
        users = [s["users"] for s in series]
        for key, style in (("p50", "-o"), ("p99", "--o")):
            latency_axis.plot(users, [(s["latency_ms"] or {}).get(key) for s in series], style,
                              label=f"{label} {key.upper()}")
            ttft_axis.plot(users, [(s["ttft_ms"] or {}).get(key) for s in series], style,
                           label=f"{label} {key.upper()}")
        throughput_axis.plot(users, [s["output_tokens_per_s"] for s in series], "-o", label=label)
    for axis, title, unit in ((latency_axis, "request latency", "ms"), (ttft_axis, "time to first token", "ms"),
                              (throughput_axis, "output tokens/s", "tokens/s")):
        axis.set_title(title)
        axis.set_xlabel("concurrent users")
        axis.set_ylabel(unit)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="http://localhost:8000", help="the server's HTTP address")
    parser.add_argument("--grpc-url", default="localhost:8001", help="the server's gRPC address")
    parser.add_argument("--openai-url", default="http://localhost:9000", help="the OpenAI front, for OpenAiChatUser")
    parser.add_argument("--openai-api-key", default=os.environ.get("GLM_OPENAI_API_KEY", ""),
                        help="its API key (default: GLM_OPENAI_API_KEY)")
    parser.add_argument("--users", default="1,8,32", help="comma-separated numbers of concurrent users")
    parser.add_argument("--spawn-rate", type=float, default=0, help="users started per second (default: all at once)")
    parser.add_argument("--run-time", default="60s", help="length of each run (Locust syntax: 30s, 2m)")
    parser.add_argument("--stop-timeout", type=int, default=10, help="seconds in-flight requests get at the end")
    parser.add_argument("--max-requests", type=int, default=0, help="also end a run after this many requests")
    parser.add_argument("--user-class", nargs="+", default=["HttpStreamUser"], choices=USER_CLASSES)
    parser.add_argument("--prompt-words", default="16-512")
    parser.add_argument("--output-tokens", default="16-256")
    parser.add_argument("--scenario", default="mixed", choices=("mixed", "shared-prefix"))
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (0: greedy; GLM-4's own default is 0.8)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p of every request (GLM-4's own default: 0.8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="default", help="name of this configuration in the summary and plot")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for reports")
    parser.add_argument("--compare", nargs="*", default=[], help="summary.json files of earlier runs to plot too")
    parser.add_argument("--allow-remote", action="store_true", help="allow a server that is not on this machine")
    args = parser.parse_args(argv)

    hosts = [urlparse(args.host).hostname or "", args.grpc_url.rsplit(":", 1)[0],
             urlparse(args.openai_url).hostname or ""]
    if not args.allow_remote and not all(is_loopback(h) for h in hosts):
        parser.error(f"{args.host} / {args.grpc_url} is not this machine; load tests stay on loopback unless "
                     "--allow-remote")
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for users in (int(u) for u in args.users.split(",")):
        prefix = os.path.abspath(os.path.join(args.out, f"{args.label}-u{users}"))  # Locust runs in HERE
        runs.append(summarize(prefix, users, args.label, locust_run(args, users, prefix)))

    summary_path = os.path.join(args.out, "summary.json")
    with open(summary_path, "w") as f:
        json.dump({"options": {k: v for k, v in vars(args).items() if k not in ("compare", "out")}, "runs": runs},
                  f, indent=2)
    compared = [run for path in args.compare for run in json.load(open(path))["runs"]]
    print_table(compared + runs)
    plot(compared + runs, os.path.join(args.out, "summary.png"))
    print(f"[loadtest] wrote {summary_path}, summary.png and Locust's CSV/HTML reports in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
