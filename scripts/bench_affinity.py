#!/usr/bin/env python3
"""What session affinity does to time to first token in multi-turn chats: two local servers behind nginx, which
spreads requests round-robin on one port and by a consistent hash of the X-Session-ID header on another (the policy
of ingress-nginx's upstream-hash-by annotation, which deploy/kubernetes/components/session-affinity sets).

    .venv/bin/python scripts/bench_affinity.py [--conversations 8] [--turns 4] [--concurrency 4] [--rounds 2]
                                               [--prefix-words 600] [--model demo|bench] [--model-dir DIR]
                                               [--json affinity.json]

Needs nginx (Debian's nginx-light). The model: the trained demo model, the benchmarks' bigger one (--model bench,
random weights, whose prefill costs more) or any checkpoint (--model-dir). Each conversation starts with a long
text of its own (a system prompt and a document, say) and adds a user message and the model's answer each turn;
every turn sends the whole history to the ensemble's generate_stream endpoint. The same kind of conversations (new texts each time, so that no policy
finds what another left in a cache) run through each policy in turn, round after round. It prints time to first
token (P50 / P90) of the first turn and of the later ones, and the prefix-cache hit rate of each policy, summed
over both servers' metrics, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

from glm_tools.demo_model import BENCH_ARCHITECTURE, DEFAULT_OUT, build_demo_model, copy_trained_demo_model
from glm_tools.launcher import TritonServer, free_port

POLICIES = {"round_robin": "", "session_hash": "hash $http_x_session_id consistent;"}
HIT_METRICS = ("glm_prefix_cache_hit_tokens_total", "glm_prefix_cache_queried_tokens_total")
WORDS = ("model", "server", "token", "cache", "request", "batch", "layer", "python", "import", "return", "value",
         "stream", "prefix", "block", "kernel", "device", "answer", "question", "table", "index")


def nginx_config(work_dir: str, backends: list[int], ports: dict[str, int]) -> str:
    servers = "".join(f"    server 127.0.0.1:{port};\n" for port in backends)
    blocks = "".join(
        f"  upstream {name} {{\n    {policy}\n{servers}  }}\n"
        f"  server {{\n    listen 127.0.0.1:{ports[name]};\n    location / {{ proxy_pass http://{name}; }}\n  }}\n"
        for name, policy in POLICIES.items())
    temp = {kind: os.path.join(work_dir, kind) for kind in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        os.makedirs(path, mode=0o777, exist_ok=True)
        os.chmod(path, 0o777)  # nginx's workers may run as another user
    return f"""worker_processes 1;
daemon off;
pid {work_dir}/nginx.pid;
error_log {work_dir}/nginx-error.log warn;
events {{ worker_connections 512; }}
http {{
  access_log off;
  client_body_temp_path {temp["body"]};
  proxy_temp_path {temp["proxy"]};
  fastcgi_temp_path {temp["fastcgi"]};
  uwsgi_temp_path {temp["uwsgi"]};
  scgi_temp_path {temp["scgi"]};
  client_body_buffer_size 1m;
  proxy_http_version 1.1;
  proxy_buffering off;
  proxy_read_timeout 600s;
{blocks}}}
"""


def start_nginx(work_dir: str, backends: list[int]) -> tuple[subprocess.Popen, dict[str, int]]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(binary):
        sys.exit("nginx is not installed: apt-get install nginx-light")
    ports = {name: free_port() for name in POLICIES}
    config = os.path.join(work_dir, "nginx.conf")
    with open(config, "w") as f:
        f.write(nginx_config(work_dir, backends, ports))
    process = subprocess.Popen([binary, "-p", work_dir, "-c", config])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if all(requests.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).ok for port in ports.values()):
                return process, ports
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    process.kill()
    sys.exit(f"nginx did not start: see {work_dir}/nginx-error.log")


def time_to_first_token(port: int, session: str, text: str, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first streamed response, and the whole answer."""
    started, first, answer = time.perf_counter(), None, []
    with requests.post(f"http://127.0.0.1:{port}/v2/models/ensemble/generate_stream", stream=True, timeout=600,
                       headers={"X-Session-ID": session},
                       json={"text_input": text, "max_tokens": max_tokens, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            first = first or time.perf_counter() - started
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise RuntimeError(event["error"])
            answer.append(event.get("text_output", ""))
    return first, "".join(answer)


def conversation(port: int, session: str, rng: random.Random, args) -> list[float]:
    """Time to first token of each turn."""
    history = f"Session {session}. " + " ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
    times = []
    for turn in range(args.turns):
        history += f"\nUser: {' '.join(rng.choice(WORDS) for _ in range(24))}\nAssistant:"
        seconds, answer = time_to_first_token(port, session, history, args.max_tokens)
        times.append(seconds)
        history += answer
    return times


def run_policy(name: str, port: int, servers: list[TritonServer], round_index: int, args) -> dict:
    before = [server.metric_totals(HIT_METRICS) for server in servers]
    sessions = [f"r{round_index}-{name}-c{index}" for index in range(args.conversations)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        turns = list(pool.map(lambda s: conversation(port, s, random.Random(s), args), sessions))
    after = [server.metric_totals(HIT_METRICS) for server in servers]
    hit, queried = (sum(a[m] - b[m] for a, b in zip(after, before)) for m in HIT_METRICS)
    return {"first_turn_s": [t[0] for t in turns], "later_turns_s": [s for t in turns for s in t[1:]],
            "prefix_hit_rate": hit / queried if queried else float("nan")}


def summarize(results: list[dict]) -> dict:
    first = [s for r in results for s in r["first_turn_s"]]
    later = [s for r in results for s in r["later_turns_s"]]
    return {"first_turn_p50_ms": 1e3 * float(np.percentile(first, 50)),
            "later_turns_p50_ms": 1e3 * float(np.percentile(later, 50)),
            "later_turns_p90_ms": 1e3 * float(np.percentile(later, 90)),
            "prefix_hit_rate": float(np.mean([r["prefix_hit_rate"] for r in results]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8, help="per policy and round")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefix-words", type=int, default=600, help="length of each conversation's first text")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length of each turn")
    parser.add_argument("--model", choices=("demo", "bench"), default="demo",
                        help="the trained demo model, or the benchmarks' 30M one (built now)")
    parser.add_argument("--model-dir", help="any checkpoint instead")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work_dir:
        model_dir = args.model_dir
        if not model_dir:
            model_dir = copy_trained_demo_model(DEFAULT_OUT)
            if args.model == "bench":  # the demo's tokenizer, so that nothing is trained here
                model_dir = build_demo_model(os.path.join(work_dir, "glm-bench"), architecture=BENCH_ARCHITECTURE,
                                             tokenizer_from=model_dir)
        servers = [TritonServer(free_port(), free_port(), free_port(), model_dir=model_dir,
                                log_path=os.path.join(work_dir, f"tritonserver-{index}.log")) for index in range(2)]
        nginx = None
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready()
            nginx, ports = start_nginx(work_dir, [server.http_port for server in servers])
            for server in servers:  # warm-up: each server's first long prompt, outside the figures
                warm_up = " ".join(WORDS) * (args.prefix_words // len(WORDS))
                requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", timeout=600,
                              json={"text_input": warm_up, "max_tokens": args.max_tokens}).raise_for_status()
            results = {name: [] for name in POLICIES}
            for round_index in range(args.rounds):
                order = list(POLICIES) if round_index % 2 == 0 else list(reversed(POLICIES))
                for name in order:
                    print(f"[affinity] round {round_index + 1}/{args.rounds}: {name}...", flush=True)
                    results[name].append(run_policy(name, ports[name], servers, round_index, args))
        finally:
            if nginx:
                nginx.terminate()
                nginx.wait(10)
            for server in servers:
                server.stop()

    summary = {name: summarize(rounds) for name, rounds in results.items()}
    print(f"\n{args.conversations} conversations x {args.turns} turns per policy and round, {args.rounds} rounds, "
          f"{args.concurrency} at once, two servers ({model_dir})")
    print(f"{'policy':<14} {'TTFT turn 1 P50':>16} {'later turns P50':>16} {'later P90':>10} {'prefix hits':>12}")
    for name, figures in summary.items():
        print(f"{name:<14} {figures['first_turn_p50_ms']:>13.0f} ms {figures['later_turns_p50_ms']:>13.0f} ms "
              f"{figures['later_turns_p90_ms']:>7.0f} ms {figures['prefix_hit_rate']:>11.0%}")
    ratio = summary["round_robin"]["later_turns_p50_ms"] / summary["session_hash"]["later_turns_p50_ms"]
    print(f"later turns' TTFT P50, round-robin over session hash: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "model_dir": model_dir, "summary": summary, "rounds": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
