#!/usr/bin/env python3
"""Attention alone on the CPU: the torch path (gather the blocks, then SDPA) against the C kernels, side by side,
rounds alternating: decode (glm_engine/cpu_decode_kernel.c, which reads the blocks in place) or, with --phase
prefill, whole prompts (cpu_prefill_kernel.c).

    .venv/bin/python scripts/bench_attention.py [--phase decode] [--seqs 32] [--rounds 8] [--json attention.json]

One decode step of the bench model's shape (8 query heads, 2 KV heads of 64), contexts drawn from 100-767 tokens,
blocks scattered over a pool of --pool-blocks. Calls go round --layers layers, each with a cache of its own, as
a step's layers do: with the default 8, what one call reads has left the caches by the time it is read again (with
--layers 1, the same 14 MB comes from the 32 MB L3 every call). Prints milliseconds per call (median and range
over the rounds) and the ratio, and writes JSON. With --phase prefill a call is one layer's attention over
--seqs whole prompts of 16-512 tokens (what a prefill step of the bench workload holds), and the figure is GFLOP/s
(the causal half of the scores, two multiply-adds a query, key and dimension).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from glm_engine.attention import AttentionMetadata, _prefill_attention, paged_attention
from glm_engine.cpu_decode_kernel import paged_decode_attention
from glm_engine.cpu_prefill_kernel import paged_prefill_attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=4096, help="KV blocks a layer")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20, help="calls timed per round and path")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(0)
    cache_shape = (args.pool_blocks, args.block_size, args.kv_heads, args.head_dim)
    caches = [(torch.randn(cache_shape, generator=generator), torch.randn(cache_shape, generator=generator))
              for _ in range(args.layers)]
    shortest, longest = (100, 768) if args.phase == "decode" else (16, 513)
    context_lens = torch.randint(shortest, longest, (args.seqs,), generator=generator)
    max_blocks = -(-int(context_lens.max()) // args.block_size)
    tables = torch.randperm(args.pool_blocks, generator=generator)[:args.seqs * max_blocks].view(args.seqs, -1)
    scale = args.head_dim ** -0.5
    layer = itertools.cycle(caches)
    if args.phase == "decode":
        q = torch.randn(args.seqs, args.heads, args.head_dim, generator=generator)
        meta = AttentionMetadata(slot_mapping=torch.zeros(args.seqs, dtype=torch.long), block_tables=tables,
                                 context_lens=context_lens, query_lens=[1] * args.seqs,
                                 host_context_lens=context_lens.tolist(), decode_kernel="torch")
        paths = {
            "torch": lambda caches: paged_attention(q, *caches, meta, scale),
            "c_kernel": lambda caches: paged_decode_attention(q, *caches, tables, context_lens, scale),
        }
        work, unit = 2 * int(context_lens.sum()) * args.kv_heads * args.head_dim * 4 / 1e9, "keys and values read, GB/s"
        description = f"{int(context_lens.sum())} context tokens, {work * 1e3:.1f} MB of keys and values a call"
    else:
        prompts = [torch.randn(n, args.heads, args.head_dim, generator=generator) for n in context_lens.tolist()]

        def prefill(attend):
            return lambda caches: [attend(q, *caches, table, len(q), scale) for q, table in zip(prompts, tables)]
        paths = {"torch": prefill(_prefill_attention), "c_kernel": prefill(paged_prefill_attention)}
        work = sum(n * (n + 1) / 2 for n in context_lens.tolist()) * args.heads * args.head_dim * 4 / 1e9
        unit, description = "GFLOP/s", f"prompts of {int(context_lens.sum())} tokens, {work:.2f} GFLOP a call"
    results = [torch.cat([r.reshape(-1) for r in (out if isinstance(out, list) else [out])])
               for out in (run(caches[0]) for run in paths.values())]
    difference = (results[0] - results[1]).abs().max().item()
    print(f"[attention] {args.phase}: {args.seqs} sequences, {description}; largest difference {difference:.1e}")

    times = {name: [] for name in paths}
    for round_index in range(args.rounds):
        for name, run in paths.items():
            run(next(layer))
            started = time.perf_counter()
            for _ in range(args.calls * args.layers):
                run(next(layer))
            times[name].append((time.perf_counter() - started) / (args.calls * args.layers) * 1000)
        print(f"[attention] round {round_index + 1}: " + ", ".join(f"{n} {t[-1]:.2f} ms" for n, t in times.items()),
              flush=True)
    ratios = [t / c for t, c in zip(times["torch"], times["c_kernel"])]
    summary = {name: {"ms_median": float(np.median(t)), "ms_range": [min(t), max(t)],
                      "rate": work / (float(np.median(t)) / 1000)} for name, t in times.items()}
    summary["c_kernel_speedup"] = float(np.median(ratios))
    summary["rate_unit"] = unit
    print(f"\n| path | ms a call (median, range) | {unit} |\n|---|---|---|")
    for name in paths:
        s = summary[name]
        print(f"| {name} | {s['ms_median']:.2f} ({s['ms_range'][0]:.2f}-{s['ms_range'][1]:.2f}) | "
              f"{s['rate']:.1f} |")
    print(f"C kernel: {summary['c_kernel_speedup']:.2f}x the torch path (median of the rounds' ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "rounds": times, "summary": summary,
                       "largest_difference": difference}, f, indent=2)
        print(f"[attention] wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
