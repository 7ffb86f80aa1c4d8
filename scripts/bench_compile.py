#!/usr/bin/env python3
"""Does compiling parts of the forward pass with torch.compile (inductor, on the CPU) pay? Decode steps of the
engine, eager against compiled variants, side by side in one process.

    .venv/bin/python scripts/bench_compile.py [--num-requests 32] [--steps 20] [--rounds 3] [--json compile.json]
                                              [--model-dir DIR]

Variants, each an engine of its own on the same checkpoint (default: the benchmarks' 30M GLM-4, built on the fly):
  eager       the engine as it serves (oneDNN-packed float32 weights);
  norms       every RMSNorm compiled (dynamic shapes): its five element-wise operations fused into one loop;
  mlp_frozen  every MLP compiled with inductor's weight freezing, the weights left unpacked so that inductor packs
              them itself and fuses SiLU * up around its own matmuls (compiling the packed layers directly fails:
              inductor lowers oneDNN's packed linear only for weights it froze itself).
Each engine gets the same requests and runs past their prefill; then rounds of --steps decode steps alternate between
the variants. It prints the median milliseconds per decode step, each variant over eager, and the compile time.
Nothing here changes the engine: it is the experiment behind docs/quantization.md#compiled-float-kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from glm_engine import EngineConfig, LLMEngine, SamplingParams
from glm_engine import glm_model
from glm_tools.demo_model import BENCH_ARCHITECTURE, build_demo_model

VARIANTS = ("eager", "norms", "mlp_frozen")


def make_engine(model_dir: str, variant: str, num_requests: int) -> LLMEngine:
    # torch's layers (not the C kernels) in every variant: what is compiled or not is torch's operators.
    config = EngineConfig(model_dir=model_dir, max_num_seqs=num_requests, num_kv_blocks=4096, layer_backend="torch")
    if variant != "mlp_frozen":
        engine = LLMEngine(config)
    else:
        pack = glm_model.Linear.pack_for_cpu
        glm_model.Linear.pack_for_cpu = lambda self, kernel: None  # inductor packs the frozen weights itself
        try:
            engine = LLMEngine(config)
        finally:
            glm_model.Linear.pack_for_cpu = pack
    for layer in engine.runner.model.model.layers:
        if variant == "norms":
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.forward = torch.compile(norm.forward, dynamic=True)
        elif variant == "mlp_frozen":
            layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
    return engine


def submit(engine: LLMEngine, num_requests: int, vocab: int) -> None:
    """The same seeded prompts (16-512 tokens) for every engine, each long enough to outlast the measurement."""
    rng = np.random.default_rng(0)
    for index in range(num_requests):
        prompt = rng.integers(16, vocab, int(rng.integers(16, 513))).tolist()
        engine.add_request(f"c{index}", prompt, SamplingParams(max_tokens=2048, stop_token_ids=()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", help="checkpoint (default: the benchmarks' 30M model, built now)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or build_demo_model(os.path.join(tempfile.mkdtemp(), "glm-bench"),
                                                   architecture=BENCH_ARCHITECTURE)

    engines, compile_s = {}, {}
    for variant in VARIANTS:
        if variant == "mlp_frozen":
            torch._inductor.config.freezing = True  # read when a graph compiles: the norms' are compiled by now
        engine = make_engine(model_dir, variant, args.num_requests)
        submit(engine, args.num_requests, engine.model_config.vocab_size)
        started = time.perf_counter()
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.sequences.values()):
            engine.step()  # the prompts' prefill, and the compilation of every shape it meets
        for _ in range(3):
            engine.step()  # the first decode shapes
        compile_s[variant] = time.perf_counter() - started
        engines[variant] = engine
        print(f"[compile] {variant}: prefill and first decode steps {compile_s[variant]:.1f}s", flush=True)

    step_ms = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            started = time.perf_counter()
            for _ in range(args.steps):
                engines[variant].step()
            step_ms[variant].append((time.perf_counter() - started) / args.steps * 1e3)
    medians = {variant: statistics.median(times) for variant, times in step_ms.items()}
    print(f"\n{args.num_requests} sequences decoding, {args.rounds} rounds of {args.steps} steps, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'variant':<12} {'ms/step':>8} {'eager / variant':>16} {'compile s':>10}")
    for variant in VARIANTS:
        print(f"{variant:<12} {medians[variant]:>8.1f} {medians['eager'] / medians[variant]:>15.2f}x "
              f"{compile_s[variant]:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "step_ms": step_ms, "median_ms": medians, "compile_s": compile_s}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
