#!/usr/bin/env python3
"""Decode attention alone on the CPU: the torch path (gather the blocks, then SDPA) against the C kernel that reads
them in place (glm_engine/cpu_decode_kernel.c), side by side, rounds alternating.

    .venv/bin/python scripts/bench_attention.py [--seqs 32] [--rounds 8] [--json attention.json]

One decode step of the bench model's shape (8 query heads, 2 KV heads of 64), contexts drawn from 100-767 tokens,
blocks scattered over a pool of --pool-blocks. Calls go round --layers layers, each with a cache of its own, as
a step's layers do: with the default 8, what one call reads has left the caches by the time it is read again (with
--layers 1, the same 14 MB comes from the 32 MB L3 every call). Prints milliseconds per call (median and range
over the rounds) and the ratio, and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from glm_engine.attention import AttentionMetadata, paged_attention
from glm_engine.cpu_decode_kernel import paged_decode_attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    context_lens = torch.randint(100, 768, (args.seqs,), generator=generator)
    max_blocks = -(-int(context_lens.max()) // args.block_size)
    tables = torch.randperm(args.pool_blocks, generator=generator)[:args.seqs * max_blocks].view(args.seqs, -1)
    q = torch.randn(args.seqs, args.heads, args.head_dim, generator=generator)
    scale = args.head_dim ** -0.5
    meta = AttentionMetadata(slot_mapping=torch.zeros(args.seqs, dtype=torch.long), block_tables=tables,
                             context_lens=context_lens, query_lens=[1] * args.seqs,
                             host_context_lens=context_lens.tolist(), decode_kernel="torch")
    layer = itertools.cycle(caches)
    paths = {
        "torch": lambda: paged_attention(q, *next(layer), meta, scale),
        "c_kernel": lambda: paged_decode_attention(q, *next(layer), tables, context_lens, scale),
    }
    difference = (paged_attention(q, *caches[0], meta, scale)
                  - paged_decode_attention(q, *caches[0], tables, context_lens, scale)).abs().max().item()
    kv_bytes = 2 * int(context_lens.sum()) * args.kv_heads * args.head_dim * 4
    print(f"[attention] {args.seqs} sequences, {int(context_lens.sum())} context tokens, "
          f"{kv_bytes / 2**20:.1f} MiB of keys and values a call; largest difference {difference:.1e}")

    times = {name: [] for name in paths}
    for round_index in range(args.rounds):
        for name, run in paths.items():
            run()
            started = time.perf_counter()
            for _ in range(args.calls * args.layers):
                run()
            times[name].append((time.perf_counter() - started) / (args.calls * args.layers) * 1000)
        print(f"[attention] round {round_index + 1}: " + ", ".join(f"{n} {t[-1]:.2f} ms" for n, t in times.items()),
              flush=True)
    ratios = [t / c for t, c in zip(times["torch"], times["c_kernel"])]
    summary = {name: {"ms_median": float(np.median(t)), "ms_range": [min(t), max(t)],
                      "kv_gb_per_s": kv_bytes / (float(np.median(t)) / 1000) / 1e9} for name, t in times.items()}
    summary["c_kernel_speedup"] = float(np.median(ratios))
    print("\n| path | ms a call (median, range) | keys and values read, GB/s |\n|---|---|---|")
    for name in paths:
        s = summary[name]
        print(f"| {name} | {s['ms_median']:.2f} ({s['ms_range'][0]:.2f}-{s['ms_range'][1]:.2f}) | "
              f"{s['kv_gb_per_s']:.1f} |")
    print(f"C kernel: {summary['c_kernel_speedup']:.2f}x the torch path (median of the rounds' ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "rounds": times, "summary": summary,
                       "largest_difference": difference}, f, indent=2)
        print(f"[attention] wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
