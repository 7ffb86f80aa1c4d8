#!/usr/bin/env python3
"""Benchmark the engine on a ~30M-parameter GLM-4 it builds, against transformers, offline and through Triton.

    .venv/bin/python scripts/bench_engine.py [--num-requests 32] [--repeat 3] [--json bench.json] [--skip-server]
                                             [--runs engine_offline,...] [--model-dir DIR] [--client asyncio]

(run ./scripts/setup_env.sh requirements-test.txt once first: it installs transformers, the baseline). It measures, on one fixed, seeded mix
of prompt lengths (16-512 tokens) and output lengths (16-256), every request running to its own length:
  - output tokens/s of the engine offline (all requests submitted at once; greedy, greedy with int8 weights and
    activations (with the LM head in int8 too: engine_offline_int8_lm_head), greedy on two tensor-parallel ranks
    over gloo (engine_offline_tp2), greedy with the torch decode attention instead of the C kernel on the CPU
    (engine_offline_torch_attention), greedy with the layers' float work in oneDNN and torch instead of the C
    kernels (engine_offline_torch_layers), and sampling with GLM-4's
    default temperature 0.8 and top_p 0.8), of transformers' generate() (greedy)
    (a) one request at a time and (b) in static left-padded batches of --batch-size, and of the engine through
    the real tritonserver with one gRPC stream per request, all at once, from one asyncio loop (--client threads:
    a thread and a channel a stream) (float32, int8, and int8 with the LM head too: the int8 runs are compared
    with the float32 ones of the same round; each also with inter_token_latency_metric per_request, compared with
    the default per_token, with coalesce_stream_responses off, one response a token, compared with the default, and
    with response_thread_nice 0, glm's response thread at the engine's priority, compared with the default 10);
  - time to first token and inter-token latency (P50/P99) of the Triton run, as its clients see them (the tokens of
    one response share the gap before it), tokens a response, the gaps between a stream's responses (P50/P99: how
    long its reader waits for the next piece of text), and the CPU seconds the server, glm's stub, the other models'
    stubs and the clients used during it;
  - KV waste at the engine's peak: allocated minus used token slots, over allocated;
  - the prefix-cache speed-up: time to first token of a request with a 1,000-token prefix, cold and then warm;
  - each run's model GFLOP/s (the workload's FLOPs over its time: model_flops) and, with the matmul_peak run, its
    share of what float32 matmuls reach here.
It prints a table and writes JSON. Figures from one run only mean something relative to each other; --repeat N
runs every measurement N times, round after round, and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from glm_engine import EngineConfig, LLMEngine, SamplingParams
from glm_engine.config import ModelConfig
from glm_tools.demo_model import BENCH_ARCHITECTURE, build_demo_model
from glm_tools.launcher import TritonServer, free_port, model_repository_with

def workload(num_requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; special tokens (ids < 16) are left out of prompts."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(16, vocab, int(rng.integers(16, 513))).tolist(), int(rng.integers(16, 257)))
            for _ in range(num_requests)]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def model_flops(config: ModelConfig, requests) -> float:
    """The floating-point operations the workload needs (two a multiply-add): every prompt and output token through
    the decoder layers' projections and attention over its context, the LM head for every output token. Norms,
    rotary and sampling are left out; padding and recomputation after preemption are not counted."""
    c = config
    projections = c.hidden_size * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 2 * c.intermediate_size) \
        + c.num_heads * c.head_dim * c.hidden_size + c.intermediate_size * c.hidden_size
    flops = 0.0
    for prompt, length in requests:
        tokens = len(prompt) + length - 1  # the last output token is sampled, never fed back
        contexts = tokens * (tokens + 1) / 2  # token i attends to i + 1 keys
        flops += 2 * c.num_layers * (projections * tokens + 2 * c.num_heads * c.head_dim * contexts)
        flops += 2 * c.hidden_size * c.vocab_size * length
    return flops


def bench_matmul_peak(size: int = 2048, repeats: int = 10) -> dict:
    """What float32 matmuls reach on this machine: the best of `repeats` [size x size] products, GFLOP/s, by
    torch.mm (MKL) and by oneDNN with its weight packed (the faster of the two counts: on AMD's Zen 5, MKL ran an
    AVX2 path at 210 against oneDNN's 480)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
    products = {"torch.mm": lambda: torch.mm(a, b),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")}
    best = {}
    for name, product in products.items():
        product()
        best[name] = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            product()
            best[name] = min(best[name], time.perf_counter() - started)
    rates = {f"{name}_gflop_per_s": 2 * size ** 3 / seconds / 1e9 for name, seconds in best.items()}
    return {"size": size, "seconds": min(best.values()), "gflop_per_s": max(rates.values()), **rates}


# GLM-4's own generation_config.json: what a chat user gets.
GLM4_SAMPLING = dict(temperature=0.8, top_p=0.8)


def bench_engine_offline(model_dir: str, requests, sampling: dict | None = None, quantization: str = "none",
                         tensor_parallel_size: int = 1, attention_backend: str = "auto",
                         layer_backend: str = "auto", quantize_lm_head: bool = False) -> dict:
    """Greedy, or with `sampling` settings (each request seeded by its index)."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=len(requests), num_kv_blocks=4096,
                                    quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                                    attention_backend=attention_backend, layer_backend=layer_backend,
                                    quantize_lm_head=quantize_lm_head))
    for index, (prompt, length) in enumerate(requests):
        settings = dict(sampling, seed=index) if sampling else {}
        engine.add_request(f"b{index}", prompt, SamplingParams(max_tokens=length, stop_token_ids=(), **settings))
    peak = {"allocated": 0, "used": 0}
    started, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        allocated = engine.pool.num_used_blocks * engine.pool.block_size
        if allocated > peak["allocated"]:
            used = sum(seq.num_computed_tokens for seq in engine.sequences.values())
            peak = {"allocated": allocated, "used": used}
    elapsed = time.perf_counter() - started
    engine.close()
    return {"output_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed,
            "kv_waste_at_peak": (peak["allocated"] - peak["used"]) / peak["allocated"],
            "peak_allocated_slots": peak["allocated"], "peak_used_slots": peak["used"]}


@torch.inference_mode()
def bench_transformers(model_dir: str, requests, batch_size: int) -> dict:
    """batch_size 1: one request at a time; otherwise static batches, left-padded, run to their longest output."""
    from transformers import Glm4ForCausalLM

    model = Glm4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    useful, started = 0, time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(length for _, length in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        useful += sum(length for _, length in batch)  # tokens past a request's own length are waste
    elapsed = time.perf_counter() - started
    return {"output_tokens": useful, "seconds": elapsed, "tokens_per_s": useful / elapsed, "batch_size": batch_size}


def bench_prefix_cache(model_dir: str, prefix_len: int = 1000) -> dict:
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=1024))
    rng = np.random.default_rng(1)
    prefix = rng.integers(16, 8000, prefix_len).tolist()

    def time_to_first_token(request_id: str) -> float:
        own = rng.integers(16, 8000, 16).tolist()
        engine.add_request(request_id, prefix + own, SamplingParams(max_tokens=1, stop_token_ids=()))
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - started

    cold, warm = time_to_first_token("cold"), time_to_first_token("warm")
    return {"prefix_tokens": prefix_len, "ttft_cold_s": cold, "ttft_warm_s": warm, "speedup": cold / warm}


def bench_triton(model_dir: str, requests, outputs=("output_ids", "sequence_length"),
                 parameters: dict[str, str] | None = None, client: str = "asyncio") -> dict:
    """One gRPC stream per request against the glm model (with these engine `parameters` over config.pbtxt's), all
    started at once. Like TensorRT-LLM's streaming client, each asks for the outputs it reads (None: all of them).
    With client "asyncio" (the default) the streams share one channel and one event loop, as a load generator's do;
    with "threads", each has a client, a channel and a thread of its own (tritonclient.grpc's callback streams),
    which on a small machine take CPU from the server: docs/performance.md measured both."""
    work_dir = tempfile.mkdtemp()
    log_path = os.path.join(work_dir, "tritonserver.log")
    repository = model_repository_with(parameters or {}, work_dir)
    run_clients = {"asyncio": _asyncio_clients, "threads": _threaded_clients}[client]
    with TritonServer(free_port(), free_port(), free_port(), model_dir=model_dir, log_path=log_path,
                      model_repository=repository) as server:
        server.wait_ready()
        stream_requests = [_stream_request(prompt, length, outputs) for prompt, length in requests]
        cpu_before = _cpu_seconds(server)
        elapsed, results = run_clients(server.grpc_url, stream_requests)
        cpu = {part: round(seconds - cpu_before[part], 2) for part, seconds in _cpu_seconds(server).items()}
    ttft = [arrivals[0][0] - sent for sent, arrivals in results]
    # The tokens of one response (coalesce_stream_responses) share the gap before it: with a token a response, the
    # gaps between tokens.
    itl = [(when - before) / count for _, arrivals in results
           for (before, _), (when, count) in zip(arrivals, arrivals[1:]) for _ in range(count)]
    # What a reader of a stream waits between one piece of text and the next, whatever each piece carries.
    gaps = [when - before for _, arrivals in results for (before, _), (when, _) in zip(arrivals, arrivals[1:])]
    tokens = sum(count for _, arrivals in results for _, count in arrivals)
    responses = sum(len(arrivals) for _, arrivals in results)
    return {"clients": len(requests), "client": client, "output_tokens": tokens, "responses": responses,
            "seconds": elapsed, "tokens_per_s": tokens / elapsed, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "response_gap_p50_s": percentile(gaps, 50), "response_gap_p99_s": percentile(gaps, 99), "cpu_s": cpu}


def process_cpu_seconds(pid: int) -> float:
    """The CPU seconds a process has used so far (user and system, from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cpu_seconds(server: TritonServer) -> dict[str, float]:
    """CPU seconds used so far by the server's own process, glm's stub, the other models' stubs and this process (the
    clients): on a machine that runs them all, what the server and the clients take is taken from the engine."""
    stubs = server.stub_processes()
    own = resource.getrusage(resource.RUSAGE_SELF)
    return {"server": process_cpu_seconds(server.process.pid),
            "glm": sum(process_cpu_seconds(pid) for pid, stub in stubs.items() if stub.model == "glm"),
            "other_models": sum(process_cpu_seconds(pid) for pid, stub in stubs.items() if stub.model != "glm"),
            "clients": own.ru_utime + own.ru_stime}


def _stream_request(prompt: list[int], length: int, outputs) -> dict:
    """The glm request of one benchmark client, as tritonclient's stream calls take it."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array, datatype in (("input_ids", np.array([prompt], np.int32), "INT32"),
                                  ("input_lengths", np.array([[len(prompt)]], np.int32), "INT32"),
                                  ("request_output_len", np.array([[length]], np.int32), "INT32"),
                                  ("streaming", np.array([[True]]), "BOOL"), ("ignore_eos", np.array([[True]]), "BOOL")):
        inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return {"model_name": "glm", "inputs": inputs,
            "outputs": None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]}


def _tokens_in(result) -> int:
    """The tokens a streamed response carries (sequence_length; 0 for an empty final response)."""
    return int(result.as_numpy("sequence_length").reshape(-1)[0]) if result.get_response().outputs else 0


def _asyncio_clients(url: str, requests: list[dict]) -> tuple[float, list]:
    """(seconds until the last stream ended, (sent, [(arrival time, tokens) of each response with tokens]) a
    request)."""
    import asyncio

    import tritonclient.grpc.aio as grpcaio

    async def one(connection, request: dict):
        async def send():
            yield request

        sent, arrivals = time.perf_counter(), []
        async for result, error in connection.stream_infer(send()):
            when = time.perf_counter()
            if error is not None:
                raise error
            if count := _tokens_in(result):
                arrivals.append((when, count))
        return sent, arrivals

    async def main():
        async with grpcaio.InferenceServerClient(url) as connection:
            started = time.perf_counter()
            results = await asyncio.gather(*(one(connection, request) for request in requests))
            return time.perf_counter() - started, results

    return asyncio.run(main())


def _threaded_clients(url: str, requests: list[dict]) -> tuple[float, list]:
    """_asyncio_clients' results, from a thread, a client and a channel a request."""
    import tritonclient.grpc as grpcclient

    results = [None] * len(requests)
    barrier = threading.Barrier(len(requests) + 1)

    def client(index: int) -> None:
        arrivals: queue.Queue = queue.Queue()
        connection = grpcclient.InferenceServerClient(url)
        connection.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), result, error)))
        barrier.wait()
        sent, received = time.perf_counter(), []
        connection.async_stream_infer(**requests[index], enable_empty_final_response=True)
        while True:
            when, result, error = arrivals.get(timeout=600)
            if error is not None:
                raise error
            if count := _tokens_in(result):
                received.append((when, count))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        connection.stop_stream()
        connection.close()
        results[index] = (sent, received)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


# The runs whose output tokens/s are compared, in the order of the table.
RUNS = ("engine_through_triton", "engine_through_triton_int8", "engine_through_triton_int8_lm_head",
        "engine_through_triton_itl_per_request", "engine_through_triton_int8_itl_per_request",
        "engine_through_triton_uncoalesced", "engine_through_triton_int8_uncoalesced",
        "engine_through_triton_nice0", "engine_through_triton_int8_nice0", "engine_offline",
        "engine_offline_int8", "engine_offline_int8_lm_head",
        "engine_offline_tp2", "engine_offline_torch_attention", "engine_offline_torch_layers", "engine_offline_sampled",
        "transformers_static_batches",
        "transformers_one_at_a_time")
THROUGH_TRITON = tuple(name for name in RUNS if "through_triton" in name)
# Runs against another run of the same round: (run, the run it is compared with, the ratio's name).
PAIRS = (("engine_offline_int8", "engine_offline", "vs_float32"),
         ("engine_through_triton_int8", "engine_through_triton", "vs_float32"),
         ("engine_offline_int8_lm_head", "engine_offline", "vs_float32"),
         ("engine_through_triton_int8_lm_head", "engine_through_triton", "vs_float32"),
         ("engine_through_triton_itl_per_request", "engine_through_triton", "vs_itl_per_token"),
         ("engine_through_triton_int8_itl_per_request", "engine_through_triton_int8", "vs_itl_per_token"),
         ("engine_through_triton", "engine_through_triton_uncoalesced", "vs_uncoalesced"),
         ("engine_through_triton_int8", "engine_through_triton_int8_uncoalesced", "vs_uncoalesced"),
         ("engine_through_triton", "engine_through_triton_nice0", "vs_nice0"),
         ("engine_through_triton_int8", "engine_through_triton_int8_nice0", "vs_nice0"),
         ("engine_offline_tp2", "engine_offline", "vs_one_rank"),
         ("engine_offline", "engine_offline_torch_attention", "vs_torch_attention"),
         ("engine_offline", "engine_offline_torch_layers", "vs_torch_layers"))
BASELINES = ("transformers_one_at_a_time", "transformers_static_batches")
INT8 = {"quantization": "int8"}
PER_REQUEST = {"inter_token_latency_metric": "per_request"}
UNCOALESCED = {"coalesce_stream_responses": "false"}
NICE0 = {"response_thread_nice": "0"}


def measurements(model_dir: str, requests, batch_size: int, client: str = "asyncio") -> dict:
    """Every measurement by name, in the order a round runs them."""
    return {
        "engine_offline": lambda: bench_engine_offline(model_dir, requests),
        "engine_offline_int8": lambda: bench_engine_offline(model_dir, requests, quantization="int8"),
        "engine_offline_int8_lm_head": lambda: bench_engine_offline(model_dir, requests, quantization="int8",
                                                                    quantize_lm_head=True),
        "engine_offline_tp2": lambda: bench_engine_offline(model_dir, requests, tensor_parallel_size=2),
        "engine_offline_torch_attention": lambda: bench_engine_offline(model_dir, requests, attention_backend="torch"),
        "engine_offline_torch_layers": lambda: bench_engine_offline(model_dir, requests, layer_backend="torch"),
        "engine_offline_sampled": lambda: bench_engine_offline(model_dir, requests, GLM4_SAMPLING),
        "matmul_peak": bench_matmul_peak,
        "transformers_one_at_a_time": lambda: bench_transformers(model_dir, requests, 1),
        "transformers_static_batches": lambda: bench_transformers(model_dir, requests, batch_size),
        "prefix_cache": lambda: bench_prefix_cache(model_dir),
        "engine_through_triton": lambda: bench_triton(model_dir, requests, client=client),
        "engine_through_triton_int8": lambda: bench_triton(model_dir, requests, parameters=INT8, client=client),
        "engine_through_triton_int8_lm_head": lambda: bench_triton(
            model_dir, requests, parameters={**INT8, "quantize_lm_head": "true"}, client=client),
        # What observing the inter-token latency at every token costs (docs/operations.md#metrics)
        "engine_through_triton_itl_per_request": lambda: bench_triton(model_dir, requests, parameters=PER_REQUEST,
                                                                      client=client),
        "engine_through_triton_int8_itl_per_request": lambda: bench_triton(
            model_dir, requests, parameters={**INT8, **PER_REQUEST}, client=client),
        # One response a token however far behind the sending falls, against the default (coalesce_stream_responses)
        "engine_through_triton_uncoalesced": lambda: bench_triton(model_dir, requests, parameters=UNCOALESCED,
                                                                  client=client),
        "engine_through_triton_int8_uncoalesced": lambda: bench_triton(
            model_dir, requests, parameters={**INT8, **UNCOALESCED}, client=client),
        # glm's response thread at the engine's priority, against the default (response_thread_nice 10)
        "engine_through_triton_nice0": lambda: bench_triton(model_dir, requests, parameters=NICE0, client=client),
        "engine_through_triton_int8_nice0": lambda: bench_triton(
            model_dir, requests, parameters={**INT8, **NICE0}, client=client),
    }


def run_round(runs: dict, names: list[str]) -> dict:
    results = {}
    for name in names:
        print(f"[bench] {name}...", flush=True)
        results[name] = runs[name]()
        print(f"[bench]   {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results[name].items()})}",
              flush=True)
    return results


def summarize(rounds: list[dict], flops: float) -> dict:
    """Medians over rounds. Ratios are taken within each round (side by side), then their median; each figure
    only where the runs it needs were made. flops: the workload's (model_flops)."""
    def median(values):
        return float(np.median(values))

    done = set(rounds[0])
    summary = {}
    for name in RUNS:
        if name not in done:
            continue
        rates = [r[name]["tokens_per_s"] for r in rounds]
        summary[name] = {"tokens_per_s": median(rates), "tokens_per_s_range": [min(rates), max(rates)],
                         "model_gflop_per_s": median([flops / r[name]["seconds"] / 1e9 for r in rounds])}
        if "matmul_peak" in done:
            summary[name]["of_matmul_peak"] = median([flops / r[name]["seconds"] / 1e9
                                                      / r["matmul_peak"]["gflop_per_s"] for r in rounds])
        for baseline, key in zip(BASELINES, ("vs_one_at_a_time", "vs_static_batches")):
            if baseline in done:
                summary[name][key] = median([r[name]["tokens_per_s"] / r[baseline]["tokens_per_s"] for r in rounds])
    for name in THROUGH_TRITON:
        if name in done:
            summary[name].update({key: median([r[name][key] for r in rounds])
                                  for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                              "response_gap_p50_s", "response_gap_p99_s")})
            summary[name]["tokens_per_response"] = median([r[name]["output_tokens"] / r[name]["responses"]
                                                           for r in rounds])
            summary[name]["cpu_s"] = {part: median([r[name]["cpu_s"][part] for r in rounds])
                                      for part in rounds[0][name]["cpu_s"]}
    for run, reference, ratio in PAIRS:
        if {run, reference} <= done:
            summary[run][ratio] = median([r[run]["tokens_per_s"] / r[reference]["tokens_per_s"] for r in rounds])
    if {"engine_offline", "engine_offline_sampled"} <= done:
        summary["sampled_vs_greedy"] = median([r["engine_offline_sampled"]["tokens_per_s"]
                                               / r["engine_offline"]["tokens_per_s"] for r in rounds])
    if "engine_offline" in done:
        summary["kv_waste_at_peak"] = median([r["engine_offline"]["kv_waste_at_peak"] for r in rounds])
    if "matmul_peak" in done:
        summary["matmul_peak_gflop_per_s"] = median([r["matmul_peak"]["gflop_per_s"] for r in rounds])
    if "prefix_cache" in done:
        summary["prefix_cache"] = {key: median([r["prefix_cache"][key] for r in rounds])
                                   for key in ("prefix_tokens", "ttft_cold_s", "ttft_warm_s", "speedup")}
    return summary


def print_summary(summary: dict, num_rounds: int) -> None:
    spread = num_rounds > 1
    print()
    if spread:
        print(f"Medians of {num_rounds} rounds; ratios within each round, then their median.")
    print("| run | output tokens/s | model GFLOP/s | of the matmul peak | vs transformers one at a time | "
          "vs static batches |\n|---|---|---|---|---|---|")
    for name in RUNS:
        if name in summary:
            row = summary[name]
            low, high = row["tokens_per_s_range"]
            rate = f"{row['tokens_per_s']:.0f}" + (f" ({low:.0f}-{high:.0f})" if spread else "")
            ratios = [f"{row[key]:.2f}x" if key in row else "-" for key in ("vs_one_at_a_time", "vs_static_batches")]
            peak = f"{row['of_matmul_peak'] * 100:.0f}%" if "of_matmul_peak" in row else "-"
            print(f"| {name} | {rate} | {row['model_gflop_per_s']:.0f} | {peak} | {' | '.join(ratios)} |")
    if "matmul_peak_gflop_per_s" in summary:
        print(f"\nfloat32 matmul peak here (2048 x 2048 products): {summary['matmul_peak_gflop_per_s']:.0f} GFLOP/s")
    for name in THROUGH_TRITON:
        if name in summary:
            t = summary[name]
            print(f"\n{name}: {t['tokens_per_response']:.2f} tokens a response; "
                  f"TTFT P50 {t['ttft_p50_s'] * 1000:.0f} ms, P99 {t['ttft_p99_s'] * 1000:.0f} "
                  f"ms; ITL P50 {t['itl_p50_s'] * 1000:.0f} ms, P99 {t['itl_p99_s'] * 1000:.0f} ms; gaps between "
                  f"responses P50 {t['response_gap_p50_s'] * 1000:.0f} ms, P99 {t['response_gap_p99_s'] * 1000:.0f} "
                  "ms; CPU seconds "
                  + ", ".join(f"{part} {seconds:.2f}" for part, seconds in t["cpu_s"].items()))
    for run, reference, ratio in PAIRS:
        if ratio in summary.get(run, {}):
            print(f"{run}: {summary[run][ratio]:.2f}x the output tokens/s of {reference}")
    if "sampled_vs_greedy" in summary:
        print(f"Sampling as GLM-4 does ({GLM4_SAMPLING}) against greedy, offline: {summary['sampled_vs_greedy']:.2f}x "
              "the output tokens/s (the transformers baselines are greedy)")
    if "kv_waste_at_peak" in summary:
        print(f"KV waste at peak: {summary['kv_waste_at_peak'] * 100:.1f}%")
    if "prefix_cache" in summary:
        p = summary["prefix_cache"]
        print(f"Prefix cache ({p['prefix_tokens']:.0f}-token prefix): TTFT {p['ttft_cold_s'] * 1000:.0f} ms cold, "
              f"{p['ttft_warm_s'] * 1000:.0f} ms warm, {p['speedup']:.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="static batch size of baseline (b)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every measurement, reported as medians (shared machines are noisy)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--skip-server", action="store_true", help="offline figures only")
    parser.add_argument("--runs", help="comma-separated measurements to make (default: all); "
                                       "engine_offline, engine_offline_int8, engine_offline_tp2, "
                                       "engine_offline_torch_attention, engine_offline_torch_layers, "
                                       "engine_offline_sampled, "
                                       "transformers_one_at_a_time, transformers_static_batches, prefix_cache, "
                                       "matmul_peak, "
                                       "engine_through_triton, engine_through_triton_int8, ... (RUNS)")
    parser.add_argument("--client", choices=("asyncio", "threads"), default="asyncio",
                        help="the through-Triton runs' clients: one asyncio loop and channel for all streams, or a "
                             "thread and a channel a stream (bench_triton)")
    parser.add_argument("--model-dir", help="benchmark this checkpoint instead of building the benchmark model "
                                            "(prompts are drawn from its vocabulary)")
    args = parser.parse_args(argv)

    if args.model_dir:
        model_dir = args.model_dir
    else:
        model_dir = build_demo_model(os.path.join(tempfile.mkdtemp(), "glm-bench"), architecture=BENCH_ARCHITECTURE)
    config = ModelConfig.from_checkpoint(model_dir)
    requests = workload(args.num_requests, vocab=config.vocab_size)
    flops = model_flops(config, requests)
    runs = measurements(model_dir, requests, args.batch_size, args.client)
    names = args.runs.split(",") if args.runs else [n for n in runs if not (args.skip_server and "triton" in n)]
    unknown = sorted(set(names) - set(runs))
    if unknown:
        parser.error(f"unknown --runs {unknown}; known: {', '.join(runs)}")
    print(f"[bench] {len(requests)} requests, prompts {min(len(p) for p, _ in requests)}-"
          f"{max(len(p) for p, _ in requests)} tokens, outputs {min(n for _, n in requests)}-"
          f"{max(n for _, n in requests)} ({sum(n for _, n in requests)} in all), {flops / 1e9:.0f} GFLOP of model "
          f"work; torch threads {torch.get_num_threads()}", flush=True)

    rounds = []
    for index in range(args.repeat):
        if args.repeat > 1:
            print(f"[bench] round {index + 1} of {args.repeat}", flush=True)
        rounds.append(run_round(runs, names))
    summary = summarize(rounds, flops)
    print_summary(summary, len(rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_requests": len(requests), "requested_output_tokens": sum(n for _, n in requests),
                       "model_flops": flops, "torch_threads": torch.get_num_threads(), "summary": summary, "rounds": rounds}, f, indent=2)
        print(f"[bench] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
