#!/usr/bin/env python3
"""What the OpenAI front costs: the same streamed requests sent to Triton's gRPC directly (the client SDK's
AsyncGrpcClient, as the front itself sends them) and through the front's /v1/completions, in alternating rounds on one
server, side by side.

    .venv/bin/python scripts/bench_openai.py [--model demo|bench] [--rounds 4] [--concurrency 8] [--max-tokens 64]
                                             [--json openai.json]

It builds the demo model (or the benchmarks' bigger one, --model bench), starts tritonserver and the front (through
glm_tools/launcher.py), and per round sends --concurrency streams at once each way, greedy, with ignore_eos both
ways (vLLM's extension of OpenAI's API, which the front takes too), so that both generate the same tokens. It prints
and writes, per way: output tokens/s over the rounds, median time to first token and to the last, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import aiohttp

from clients import AsyncGrpcClient
from glm_tools.demo_model import BENCH_ARCHITECTURE, build_demo_model
from glm_tools.launcher import TritonServer, free_port, start_openai_front, wait_for_openai_front

PROMPTS = ["def parse_arguments(argv):", "class Config:", "import os\nimport sys\n", "你好，请介绍一下你自己。",
           "for index, item in enumerate(items):", "The quick brown fox", "SELECT name FROM users WHERE",
           "async def fetch(session, url):"]


async def grpc_stream(client: AsyncGrpcClient, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    started = time.perf_counter()
    first = None
    async with client.stream(prompt, max_tokens=max_tokens, ignore_eos=True) as stream:
        async for _ in stream:
            first = first or time.perf_counter()
    return first - started, time.perf_counter() - started, stream.generation.num_output_tokens


async def openai_stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
                        ) -> tuple[float, float, int]:
    started = time.perf_counter()
    first, tokens = None, 0
    body = {"model": "glm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["text"]:
                first = first or time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return first - started, time.perf_counter() - started, tokens


async def measure(grpc_url: str, openai_url: str, rounds: int, concurrency: int, max_tokens: int) -> dict:
    results = {"grpc": [], "openai": []}
    wall = {"grpc": 0.0, "openai": 0.0}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    async with AsyncGrpcClient(grpc_url) as client, aiohttp.ClientSession() as session:
        await asyncio.gather(*(grpc_stream(client, p, 8) for p in prompts))  # warm-up
        for round_number in range(rounds):
            # Alternate which way goes first, so that neither always follows the other.
            order = ("grpc", "openai") if round_number % 2 == 0 else ("openai", "grpc")
            for way in order:
                started = time.perf_counter()
                if way == "grpc":
                    streams = [grpc_stream(client, p, max_tokens) for p in prompts]
                else:
                    streams = [openai_stream(session, openai_url, p, max_tokens) for p in prompts]
                results[way] += await asyncio.gather(*streams)
                wall[way] += time.perf_counter() - started
            print(f"[bench-openai] round {round_number + 1}/{rounds} done", flush=True)
    summary = {}
    for way, samples in results.items():
        tokens = sum(sample[2] for sample in samples)
        summary[way] = {"streams": len(samples), "output_tokens": tokens,
                        "tokens_per_s": round(tokens / wall[way], 1),
                        "ttft_ms_p50": round(statistics.median(s[0] for s in samples) * 1000, 1),
                        "latency_ms_p50": round(statistics.median(s[1] for s in samples) * 1000, 1)}
    summary["ratios"] = {
        "tokens_per_s": round(summary["openai"]["tokens_per_s"] / summary["grpc"]["tokens_per_s"], 3),
        "ttft_p50": round(summary["openai"]["ttft_ms_p50"] / summary["grpc"]["ttft_ms_p50"], 3),
        "latency_p50": round(summary["openai"]["latency_ms_p50"] / summary["grpc"]["latency_ms_p50"], 3)}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo", "bench"), default="demo")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)

    work_dir = tempfile.mkdtemp(prefix="bench-openai-")
    model_dir = build_demo_model(os.path.join(work_dir, "model"),
                                 architecture=BENCH_ARCHITECTURE if args.model == "bench" else None)
    with TritonServer(free_port(), free_port(), free_port(), model_dir=model_dir,
                      log_path=os.path.join(work_dir, "tritonserver.log")) as server:
        server.wait_ready()
        port = free_port()
        front = start_openai_front(server.grpc_url, port, model_dir=model_dir)
        try:
            openai_url = f"http://127.0.0.1:{port}"
            wait_for_openai_front(openai_url)
            summary = asyncio.run(measure(server.grpc_url, openai_url, args.rounds, args.concurrency,
                                          args.max_tokens))
        finally:
            front.terminate()
            front.wait(timeout=30)
    summary["options"] = vars(args)
    for way in ("grpc", "openai"):
        figures = summary[way]
        print(f"[bench-openai] {way:6}: {figures['tokens_per_s']} tokens/s, TTFT p50 {figures['ttft_ms_p50']} ms, "
              f"latency p50 {figures['latency_ms_p50']} ms ({figures['streams']} streams)")
    print(f"[bench-openai] through the front / direct: {summary['ratios']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
