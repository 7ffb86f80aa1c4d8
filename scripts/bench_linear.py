#!/usr/bin/env python3
"""One linear layer, float against 8-bit, at the shapes of the benchmark model's projections and several row counts.

    .venv/bin/python scripts/bench_linear.py [--rows 1,32,256,2048] [--repeat 30] [--json F]

Side by side, on the same input: the engine's float32 layer (oneDNN-packed, glm_model.Linear), its int8 layer
(glm_engine/quantization.py: per-token activation scales, `torch._int_mm`, the epilogue), `_int_mm` alone (what the
integer product costs without quantizing and rescaling), and fbgemm's dynamic int8 layer (`torch.ao`'s, which
scales activations per tensor: faster where it is, but a token's result then depends on the rest of the batch).
Prints GFLOP/s-equivalent (2 * rows * in * out / time) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

from glm_engine.glm_model import Linear
from glm_engine.quantization import QuantizedLinear, quantize_rows, quantize_weight
from glm_tools.demo_model import BENCH_ARCHITECTURE

HIDDEN, INTER = BENCH_ARCHITECTURE["hidden_size"], BENCH_ARCHITECTURE["intermediate_size"]
QKV = (BENCH_ARCHITECTURE["num_attention_heads"] + 2 * BENCH_ARCHITECTURE["num_key_value_heads"]) \
    * BENCH_ARCHITECTURE["head_dim"]
SHAPES = {"qkv_proj": (HIDDEN, QKV), "o_proj": (HIDDEN, HIDDEN), "gate_up_proj": (HIDDEN, 2 * INTER),
          "down_proj": (INTER, HIDDEN)}


def seconds(run, repeat: int) -> float:
    run(), run()
    started = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - started) / repeat


def layers(in_features: int, out_features: int):
    weight = torch.randn(out_features, in_features) * 0.05
    dense = Linear(in_features, out_features, bias=False)
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    dense.pack_for_cpu()
    int8 = QuantizedLinear(in_features, out_features, bias=False, method="int8")
    int8.weight, int8.weight_scale = quantize_weight(weight, "int8")
    with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated, and still the fbgemm path
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(weight, int8.weight_scale.double(), torch.zeros(out_features).long(),
                                             0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    return dense, int8, packed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,256,2048", help="tokens per product (decode batch or prefill)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    print(f"[linear] torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s-equivalent", flush=True)
    print("\n| layer | rows | float32 (oneDNN) | int8 (engine) | int8 vs float32 | _int_mm alone | fbgemm dynamic "
          "(per-tensor) |\n|---|---:|---:|---:|---:|---:|---:|")
    results = []
    with torch.inference_mode():
        for name, (in_features, out_features) in SHAPES.items():
            dense, int8, packed = layers(in_features, out_features)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                values, _ = quantize_rows(x, "int8")
                weight_t = int8.weight.t()
                times = {
                    "float32": seconds(lambda: dense(x), args.repeat),
                    "int8": seconds(lambda: int8(x), args.repeat),
                    "int_mm_alone": seconds(lambda: torch._int_mm(values, weight_t), args.repeat),
                    "fbgemm_dynamic": seconds(lambda: torch.ops.quantized.linear_dynamic(x, packed, False),
                                              args.repeat),
                }
                flops = 2 * rows * in_features * out_features
                row = {"layer": name, "rows": rows, "in": in_features, "out": out_features,
                       **{f"{k}_gflops": flops / t / 1e9 for k, t in times.items()},
                       "int8_vs_float32": times["float32"] / times["int8"]}
                results.append(row)
                print(f"| {name} [{in_features} x {out_features}] | {rows} | {row['float32_gflops']:.0f} | "
                      f"{row['int8_gflops']:.0f} | {row['int8_vs_float32']:.2f}x | {row['int_mm_alone_gflops']:.0f} | "
                      f"{row['fbgemm_dynamic_gflops']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}, f,
                      indent=2)
        print(f"[linear] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
