#!/usr/bin/env python3
"""Time the engine thread's work per generated token outside the model: one request's OutputProcessor
(glm_engine/output_processor.py), with no stop strings and with many long ones.

    .venv/bin/python scripts/bench_output_processor.py [--model-dir checkpoints/glm-demo] [--json out.json]
    .venv/bin/python scripts/bench_output_processor.py --baseline e865d59   # stop strings against that commit's

It streams the same generated text, token by token, through an OutputProcessor with 0, 1, 8 and 64 stop strings
(64 is the request limit) of 8 and 128 characters, and prints the microseconds per token (the median of --repeat
runs). The stop strings are built to cost as much as possible: each shares a long beginning with the text, so the
matcher goes deep and falls back often, and none ever completes. With --baseline, it also times the stop-string
filter alone (StopStringFilter.push, on the same whole-character chunks) against the filter of a git commit's
engine, the two in turn. It writes JSON with --json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

from glm_engine import FinishReason, RequestOutput
from glm_engine.output_processor import OutputProcessor
from glm_engine.sampling_params import RULES
from glm_engine.stop_strings import StopStringFilter
from glm_engine.tokenizer import CompleteTextChunker, GlmTokenizer
from glm_tools.demo_model import build_demo_model
from glm_tools.engine_versions import engine_at

TEXT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)  # 配置文件\n" * 40


def stop_strings(count: int, length: int) -> list[str]:
    """count strings of `length` characters: the start of TEXT with the last character changed, so that none
    ever matches but every one is followed deep into the text."""
    start = (TEXT * (length // len(TEXT) + 1))[:length - 1]
    return [start + chr(0x4E00 + i) for i in range(count)]


def cases() -> list[tuple[int, int]]:
    limit = RULES["stop"]
    return [(0, 0)] + [(count, length) for count in (1, 8, limit.max_items) for length in (8, limit.max_chars)]


def per_token(run, repeat: int, tokens: int) -> float:
    """Median microseconds per token of run() over `repeat` runs."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) / tokens * 1e6)
    return statistics.median(times)


def stream_through_processor(tokenizer: GlmTokenizer, ids: list[int], stops: list[str], streaming: bool) -> None:
    processor = OutputProcessor(tokenizer, [1, 2, 3], streaming, False, stops)
    for index, token in enumerate(ids):
        last = index == len(ids) - 1
        reason = FinishReason.LENGTH if last else None
        processor.process(RequestOutput("r", [token], finished=last, finish_reason=reason))


def baseline_filter(commit: str):
    """StopStringFilter of a commit's engine (in tokenizer.py before it had a module of its own)."""
    package = engine_at(commit).__name__
    for module in ("stop_strings", "tokenizer"):
        try:
            return importlib.import_module(f"{package}.{module}").StopStringFilter
        except (ImportError, AttributeError):
            continue
    raise SystemExit(f"{commit} has no StopStringFilter")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a checkpoint whose tokenizer to use (default: build the demo model)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--baseline", help="a git commit whose stop-string filter to time side by side")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or build_demo_model(os.path.join(tempfile.mkdtemp(), "glm-demo"))
    tokenizer = GlmTokenizer(model_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    print(f"{len(ids)} tokens, {len(TEXT)} characters\n")

    print("| stop strings | characters each | streaming us/token | single response us/token |\n|---|---|---|---|")
    processor_rows = []
    for count, length in cases():
        stops = stop_strings(count, length)
        row = {"stop_strings": count, "characters": length}
        for streaming, key in ((True, "streaming_us"), (False, "single_us")):
            row[key] = per_token(lambda: stream_through_processor(tokenizer, ids, stops, streaming), args.repeat,
                                 len(ids))
        processor_rows.append(row)
        print(f"| {count} | {length} | {row['streaming_us']:.1f} | {row['single_us']:.1f} |", flush=True)

    filter_rows = []
    if args.baseline:
        chunker = CompleteTextChunker(tokenizer)
        chunks = [chunker.push([token]) for token in ids]
        filters = {"current": StopStringFilter, "baseline": baseline_filter(args.baseline)}

        def push_all(filter_class, stops):
            stop_filter = filter_class(stops)
            for chunk in chunks:
                stop_filter.push(*chunk)

        print(f"\nStopStringFilter.push alone, against {args.baseline}'s:\n"
              "| stop strings | characters each | us/token | baseline us/token | speed-up |\n|---|---|---|---|---|")
        for count, length in cases()[1:]:
            stops = stop_strings(count, length)
            row = {"stop_strings": count, "characters": length}
            for name, filter_class in filters.items():
                row[f"{name}_us"] = per_token(lambda: push_all(filter_class, stops), args.repeat, len(ids))
            row["speedup"] = row["baseline_us"] / row["current_us"]
            filter_rows.append(row)
            print(f"| {count} | {length} | {row['current_us']:.1f} | {row['baseline_us']:.1f} | "
                  f"{row['speedup']:.0f}x |", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": len(ids), "baseline": args.baseline, "output_processor": processor_rows,
                       "stop_string_filter": filter_rows}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
