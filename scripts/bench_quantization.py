#!/usr/bin/env python3
"""What quantization costs in quality, on the trained demo model: held-out perplexity, greedy agreement, memory.

    .venv/bin/python scripts/bench_quantization.py [--model-dir demo_checkpoint] [--methods none,int8,fp8]
                                                   [--windows 64] [--prompts 100] [--max-tokens 32] [--json F]

For each quantization (the engine's `quantization` parameter; fp8 is emulated on the CPU, which gives FP8's numbers
and not its speed; "+lm_head": the LM head quantized too, the engine's quantize_lm_head, off by default) it
measures, with the engine itself:
  - the perplexity of the held-out text of glm_tools/train_demo.py (files the model never trained on), over
    --windows windows of 256 tokens, each computed from an empty KV cache;
  - greedy agreement with the first method (float): over --prompts prompts (the first 32 tokens of held-out
    windows), the share whose --max-tokens greedy tokens are all identical, and the mean share of tokens that agree
    before the first difference;
  - the weights' memory (what the engine's memory check counts) and the time of the perplexity pass.
It prints a table and writes JSON. Speed is scripts/bench_engine.py's (its *_int8 runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tokenizers import Tokenizer

from glm_engine import EngineConfig, LLMEngine, SamplingParams
from glm_engine.memory import weight_bytes
from glm_tools.demo_model import TRAINED_CHECKPOINT
from glm_tools.quality import WINDOW, held_out_stream, perplexity, windows

PROMPT_TOKENS = 32


def measure(model_dir: str, method: str, token_windows, prompts, max_tokens: int) -> dict:
    """method: a quantization, or one with "+lm_head" (the LM head quantized too)."""
    quantization, _, head = method.partition("+")
    engine = LLMEngine(EngineConfig(model_dir=model_dir, quantization=quantization, quantize_lm_head=bool(head),
                                    num_kv_blocks=1024))
    started = time.perf_counter()
    ppl = perplexity(engine, token_windows)
    seconds = time.perf_counter() - started
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, stop_token_ids=()))
    quantized = engine.runner.quantized_weight_names
    return {"method": method, "perplexity": ppl, "perplexity_seconds": seconds, "outputs": outputs,
            "weight_bytes": weight_bytes(model_dir, engine.runner.dtype, quantized)}


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """(share of outputs identical to the reference, mean share of tokens agreeing before the first difference)."""
    identical, prefix = 0, 0.0
    for ref, out in zip(reference, outputs):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        identical += ref == out
        prefix += same / len(ref)
    return identical / len(reference), prefix / len(reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=TRAINED_CHECKPOINT)
    parser.add_argument("--methods", default="none,int8,fp8,int8+lm_head,fp8+lm_head",
                        help="quantizations to compare (+lm_head: the LM head too); the first is the reference for "
                             "agreement")
    parser.add_argument("--windows", type=int, default=64, help=f"held-out windows of {WINDOW} tokens")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    stream = held_out_stream(Tokenizer.from_file(os.path.join(args.model_dir, "tokenizer.json")))
    token_windows = windows(stream, args.windows)
    every = windows(stream, len(stream))
    prompts = [window[:PROMPT_TOKENS] for window in every[::max(1, len(every) // args.prompts)]][: args.prompts]
    print(f"[quality] {args.model_dir}: {len(token_windows)} held-out windows of {WINDOW} tokens, {len(prompts)} "
          f"prompts of {PROMPT_TOKENS} tokens, {args.max_tokens} greedy tokens each", flush=True)

    results = []
    for method in args.methods.split(","):
        print(f"[quality] {method}...", flush=True)
        results.append(measure(args.model_dir, method, token_windows, prompts, args.max_tokens))
    reference = results[0]
    print(f"\n| quantization | held-out perplexity | vs {reference['method']} | greedy outputs identical | tokens "
          f"agreeing before a difference | weights MiB | perplexity pass s |\n|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        row["perplexity_vs_reference"] = row["perplexity"] / reference["perplexity"]
        row["identical"], row["agreeing_prefix"] = agreement(reference["outputs"], row["outputs"])
        print(f"| {row['method']} | {row['perplexity']:.3f} | {row['perplexity_vs_reference']:.4f}x | "
              f"{row['identical'] * 100:.0f}% | {row['agreeing_prefix'] * 100:.1f}% | "
              f"{row['weight_bytes'] / 2**20:.1f} | {row['perplexity_seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_dir": args.model_dir, "windows": len(token_windows), "window_tokens": WINDOW,
                       "prompts": len(prompts), "max_tokens": args.max_tokens,
                       "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results]}, f, indent=2)
        print(f"[quality] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
