#!/usr/bin/env python3
"""Time the sampler (glm_engine/sampler.py) on one step's logits, optionally side by side with another version.

    .venv/bin/python scripts/bench_sampler.py [--vocab 8192,151552] [--batch 1,16,64] [--json sampler.json]
    .venv/bin/python scripts/bench_sampler.py --baseline f01c9fb    # against the sampler of that commit

For each vocabulary size, batch size, request setting and shape of the logits, it prints the milliseconds one call
of sample() takes (the median of --repeat calls) and, with --baseline, the baseline's time and the ratio. The
baseline is the engine package of a git commit, each version timed on sequences of its own classes; the two run
alternately, call by call, on the same logits. The logits are random (glm_tools/sampling_cases.py): "peaked" ones
put the top-p set on a few tokens, as a confident model does; "flat" ones spread it over thousands, the worst
case for top-p. GLM-4's vocabulary has 151,552 tokens; the demo and benchmark models 8,192.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from glm_engine import sampler, sequence
from glm_tools.engine_versions import engine_at
from glm_tools.sampling_cases import LOGIT_SCALES, SETTINGS, make_sequences


def load_version(commit: str) -> SimpleNamespace:
    """The sampler and sequence modules of a git commit's engine."""
    package = engine_at(commit).__name__
    return SimpleNamespace(sampler=importlib.import_module(f"{package}.sampler"),
                           sequence=importlib.import_module(f"{package}.sequence"))


def time_calls(calls: dict, logits: torch.Tensor, repeat: int) -> dict[str, float]:
    """Median milliseconds per call of each (sample, sequences), called in turn on copies of the same logits."""
    times = {name: [] for name in calls}
    for _ in range(repeat + 1):  # the first round warms up and is dropped
        for name, (sample, seqs) in calls.items():
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
    parser.add_argument("--baseline", help="a git commit whose sampler to time side by side")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    versions = {"current": SimpleNamespace(sampler=sampler, sequence=sequence)}
    if args.baseline:
        versions["baseline"] = load_version(args.baseline)
    header = f"{'vocab':>7} {'batch':>5}  {'setting':34} {'logits':6} {'ms':>8}"
    print(header + (f" {'baseline ms':>11} {'speed-up':>8}" if args.baseline else ""))
    results = []
    for vocab in map(int, args.vocab.split(",")):
        for batch in map(int, args.batch.split(",")):
            for setting, values in SETTINGS.items():
                calls = {name: (version.sampler.sample, make_sequences(batch, values, vocab, version.sequence))
                         for name, version in versions.items()}
                for shape, scale in LOGIT_SCALES.items():
                    if setting == "greedy" and shape == "flat":
                        continue  # greedy does not look at the shape
                    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * scale
                    ms = time_calls(calls, logits, args.repeat)
                    row = dict(vocab=vocab, batch=batch, setting=setting, logits=shape, ms=ms["current"])
                    line = f"{vocab:>7} {batch:>5}  {setting:34} {shape:6} {ms['current']:8.2f}"
                    if args.baseline:
                        row.update(baseline_ms=ms["baseline"], speedup=ms["baseline"] / ms["current"])
                        line += f" {ms['baseline']:11.2f} {row['speedup']:7.2f}x"
                    print(line, flush=True)
                    results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=torch.get_num_threads(), baseline=args.baseline, settings=SETTINGS, results=results),
                      f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
