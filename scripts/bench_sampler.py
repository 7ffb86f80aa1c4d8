#!/usr/bin/env python3
"""Time the sampler (glm_engine/sampler.py) on one step's logits, optionally side by side with another version.

    .venv/bin/python scripts/bench_sampler.py [--vocab 8192,151552] [--batch 1,16,64] [--json sampler.json]
    git show COMMIT:backends/python_glm/glm_engine/sampler.py > /tmp/sampler_then.py
    .venv/bin/python scripts/bench_sampler.py --baseline /tmp/sampler_then.py

For each vocabulary size, batch size, request setting and shape of the logits, it prints the milliseconds one call
of sample() takes (the median of --repeat calls) and, with --baseline, the baseline's time and the ratio. The two
run alternately, call by call, on the same logits. The logits are random: "peaked" ones (normal, standard deviation
4) put the top-p set on a few tokens, as a confident model does; "flat" ones (deviation 1) spread it over
thousands, the worst case for top-p. GLM-4's vocabulary has 151,552 tokens; the demo and benchmark models 8,192.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "backends", "python_glm"))

from glm_engine import sampler  # noqa: E402
from glm_engine.sequence import SamplingParams, Sequence  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "GLM-4 default (T 0.8, top_p 0.8)": dict(temperature=0.8, top_p=0.8),
    "T 0.7, top_k 50, top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "T 0.7, top_p 0.9, repetition 1.1": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
}
LOGIT_SCALES = {"peaked": 4.0, "flat": 1.0}


def load_sampler(path: str):
    """Load a sampler.py from another commit as a module of the glm_engine package, so its imports resolve."""
    spec = importlib.util.spec_from_file_location("glm_engine.baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_sequences(batch: int, params: SamplingParams, vocab: int) -> list[Sequence]:
    """Sequences of 300 prompt and 100 output tokens, each with its own seed."""
    seqs = []
    for i in range(batch):
        seq = Sequence(str(i), [(i + t) % vocab for t in range(400)], 300, params, frozenset({2}), seed=i)
        seq.generator = None  # read by samplers before the batched one, which kept a torch.Generator per sequence
        seqs.append(seq)
    return seqs


def time_calls(functions: dict, logits: torch.Tensor, seqs: list[Sequence], repeat: int) -> dict[str, float]:
    """Median milliseconds per call of each function, called in turn on copies of the same logits."""
    times = {name: [] for name in functions}
    for _ in range(repeat + 1):  # the first round warms up and is dropped
        for name, sample in functions.items():
            copy = logits.clone()
            started = time.perf_counter()
            sample(copy, seqs)
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="8192,151552", help="vocabulary sizes, comma-separated")
    parser.add_argument("--batch", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=7, help="calls per figure (median)")
    parser.add_argument("--baseline", help="another sampler.py to time side by side")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    functions = {"current": sampler.sample}
    if args.baseline:
        functions["baseline"] = load_sampler(args.baseline).sample
    header = f"{'vocab':>7} {'batch':>5}  {'setting':34} {'logits':6} {'ms':>8}"
    print(header + (f" {'baseline ms':>11} {'speed-up':>8}" if args.baseline else ""))
    results = []
    for vocab in map(int, args.vocab.split(",")):
        for batch in map(int, args.batch.split(",")):
            for setting, values in SETTINGS.items():
                seqs = make_sequences(batch, SamplingParams(max_tokens=200, **values), vocab)
                for shape, scale in LOGIT_SCALES.items():
                    if setting == "greedy" and shape == "flat":
                        continue  # greedy does not look at the shape
                    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * scale
                    ms = time_calls(functions, logits, seqs, args.repeat)
                    row = dict(vocab=vocab, batch=batch, setting=setting, logits=shape, ms=ms["current"])
                    line = f"{vocab:>7} {batch:>5}  {setting:34} {shape:6} {ms['current']:8.2f}"
                    if args.baseline:
                        row.update(baseline_ms=ms["baseline"], speedup=ms["baseline"] / ms["current"])
                        line += f" {ms['baseline']:11.2f} {row['speedup']:7.2f}x"
                    print(line, flush=True)
                    results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=torch.get_num_threads(), baseline=args.baseline, results=results), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
