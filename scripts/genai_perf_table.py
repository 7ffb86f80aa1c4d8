#!/usr/bin/env python3
"""genai-perf against each way in: the ensemble (TensorRT-LLM style), vllm_model (vllm_backend style), bls and the
OpenAI front's chat endpoint, with the same load, and one table of what it measured.

    ./scripts/setup_genai_perf.sh && source .venv-genai/env     # genai-perf and perf_analyzer
    ./scripts/serve.sh &                                        # Triton on 8000/8001, the OpenAI front on 9000
    .venv/bin/python scripts/genai_perf_table.py --tokenizer checkpoints/glm-demo [--concurrency 4]
                                                  [--request-count 40] [--isl 128] [--osl 64] [--out genai-perf]

genai-perf needs --tokenizer (the checkpoint's directory): offline it cannot fetch one. Every request asks for
exactly --osl tokens (ignore_eos), and genai-perf counts output tokens by re-tokenizing the text it received, which
for a random model's text can give more tokens than the engine generated. Prints each command as it runs it, then a
Markdown table; writes the table and every run's figures as JSON in --out, with each run's whole output (genai-perf
and perf_analyzer, --verbose) as <way in>/genai-perf-<attempt>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

TARGETS = {  # name -> genai-perf arguments that pick the model, its interface and its address
    "ensemble": ["-m", "ensemble", "--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming"],
    "vllm_model": ["-m", "vllm_model", "--endpoint-type", "kserve", "--backend", "vllm", "--streaming"],
    "bls": ["-m", "bls", "--endpoint-type", "kserve", "--backend", "tensorrtllm"],
    "openai chat": ["-m", "glm", "--endpoint-type", "chat", "--streaming"],
}
COLUMNS = (("output tokens/s", "output_token_throughput", "avg"), ("requests/s", "request_throughput", "avg"),
           ("TTFT p50 ms", "time_to_first_token", "p50"), ("TTFT p99 ms", "time_to_first_token", "p99"),
           ("ITL p50 ms", "inter_token_latency", "p50"), ("latency p50 ms", "request_latency", "p50"))


def run(name: str, args: argparse.Namespace) -> dict:
    url = args.openai_url if name.startswith("openai") else args.grpc_url
    artifacts = os.path.join(args.out, name.replace(" ", "-"))
    command = [args.genai_perf, "profile", *TARGETS[name], "-u", url, "--tokenizer", args.tokenizer,
               "--synthetic-input-tokens-mean", str(args.isl), "--output-tokens-mean", str(args.osl),
               "--extra-inputs", "ignore_eos:true", "--concurrency", str(args.concurrency),
               "--request-count", str(args.request_count), "--warmup-request-count", str(args.concurrency),
               "--artifact-dir", artifacts, "--verbose"]
    if name.startswith("openai") and args.openai_api_key:
        command += ["--header", f"Authorization: Bearer {args.openai_api_key}"]
    shown = [part.replace(args.openai_api_key, "***") if args.openai_api_key else part for part in command]
    print(f"[genai-perf] {shlex.join(shown)}", flush=True)
    os.makedirs(artifacts, exist_ok=True)
    for attempt in range(1, args.attempts + 1):
        # genai-perf's and perf_analyzer's own words (--verbose); genai-perf alone would drop perf_analyzer's
        log = os.path.join(artifacts, f"genai-perf-{attempt}.log")
        with open(log, "w") as f:
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, text=True)
        if done.returncode == 0:
            break
        with open(log) as f:
            sys.stderr.write(f.read()[-6000:])
        failure = f"genai-perf failed on {name} (exit {done.returncode}); its whole output: {log}"
        if attempt == args.attempts:
            raise SystemExit(failure)
        print(f"[genai-perf] {failure}; trying again", file=sys.stderr, flush=True)
    for root, _, files in os.walk(artifacts):
        if "profile_export_genai_perf.json" in files:
            with open(os.path.join(root, "profile_export_genai_perf.json")) as f:
                return {**json.load(f), "attempts": attempt}
    raise SystemExit(f"genai-perf wrote no profile_export_genai_perf.json under {artifacts}; its output: {log}")


def table(results: dict[str, dict]) -> str:
    lines = ["| way in | " + " | ".join(title for title, _, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for name, figures in results.items():
        cells = []
        for _, metric, statistic in COLUMNS:
            value = figures.get(metric, {}).get(statistic)
            cells.append("n/a" if value is None else f"{value:,.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="the served checkpoint's directory")
    parser.add_argument("--grpc-url", default="localhost:8001")
    parser.add_argument("--openai-url", default="localhost:9000")
    parser.add_argument("--openai-api-key", default=os.environ.get("GLM_OPENAI_API_KEY", ""),
                        help="the front's API key, if it wants one (default: GLM_OPENAI_API_KEY)")
    parser.add_argument("--genai-perf", default="genai-perf")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--request-count", type=int, default=40)
    parser.add_argument("--isl", type=int, default=128, help="prompt tokens (genai-perf's synthetic prompts)")
    parser.add_argument("--osl", type=int, default=64, help="output tokens asked for")
    parser.add_argument("--attempts", type=int, default=2,
                        help="runs of genai-perf per way in before giving up (twice in about twenty CI runs, genai-perf "
                             "found perf_analyzer's profile export empty); every attempt's output is kept")
    parser.add_argument("--only", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--out", default="genai-perf")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {name: run(name, args) for name in args.only}
    markdown = table(results)
    print(markdown, end="")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"options": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
