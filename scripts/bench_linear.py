#!/usr/bin/env python3
"""One linear layer, float against 8-bit, at the shapes of the benchmark model's projections and several row counts.

    .venv/bin/python scripts/bench_linear.py [--rows 1,32,256,2048] [--repeat 30] [--json F]

Side by side, on the same input: the float32 layer (glm_model.Linear) packed for oneDNN and for the C kernel
(glm_engine/cpu_linear_kernel.c, the engine's default on the CPU), the engine's int8 layer as it runs on this CPU
with its default C kernels and with layer_backend torch (glm_engine/quantization.py, int8_cpu_kernel: the C kernel
cpu_int8_kernel.c, `torch._int_mm`, or without VNNI oneDNN's uint8 x int8 product of 7-bit activations), the
integer product alone on the _int_mm and oneDNN paths (what it costs without quantizing and rescaling), on a CPU
with AMX the C kernel called alone (no module call) in its AMX build and in its VNNI build (-mno-amx-tile
-mno-amx-int8), side by side: what the tiles are worth, and
fbgemm's dynamic int8 layer (`torch.ao`'s, which scales activations per tensor: faster where it is, but a token's
result then depends on the rest of the batch).
Prints GFLOP/s-equivalent (2 * rows * in * out / time) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

from glm_engine import cpu_int8_kernel
from glm_engine.glm_model import Linear
from glm_engine.model_runner import describe_int8_path
from glm_engine.quantization import (INT7_MAX, QuantizedLinear, cpu_has_int8_dot_product, int8_cpu_kernel,
                                     pack_int8_for_avx2, quantize_rows, quantize_weight)
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
    dense_c = Linear(in_features, out_features, bias=False)
    dense_c.weight = torch.nn.Parameter(weight, requires_grad=False)
    dense.pack_for_cpu("onednn")
    dense_c.pack_for_cpu("cpu")  # the engine's float32 layer where the C kernel builds
    int8s = []
    for layer_kernels in ("cpu", "torch"):  # as the engine packs them
        int8 = QuantizedLinear(in_features, out_features, bias=False, method="int8")
        int8.weight, int8.weight_scale = values, scales = quantize_weight(weight, "int8")
        int8.pack_for_cpu(layer_kernels)
        int8s.append(int8)
    with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated, and still the fbgemm path
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(weight, scales.double(), torch.zeros(out_features).long(), 0,
                                             torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    return dense, dense_c, *int8s, values, scales, packed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,256,2048", help="tokens per product (decode batch or prefill)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    vnni = cpu_has_int8_dot_product()
    print(f"[linear] torch {torch.__version__}, {torch.get_num_threads()} threads, int8 dot product (VNNI/AMX): "
          f"{'yes' if vnni else 'no'}; int8 products: {describe_int8_path('cpu')}; with layer_backend torch: "
          f"{describe_int8_path('torch')}; GFLOP/s-equivalent", flush=True)
    print("\n| layer | rows | float32 (oneDNN) | float32 (C kernel) | int8 (engine) | int8 (layer_backend torch) "
          "| int8 (engine) vs float32 (C kernel) | int8 C kernel alone: AMX / without AMX | _int_mm alone "
          "| oneDNN u8 x s8 alone "
          "| fbgemm dynamic (per-tensor) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    amx = int8_cpu_kernel("cpu") == "cpu" and cpu_int8_kernel.load().uses_amx
    results = []
    with torch.inference_mode():
        for name, (in_features, out_features) in SHAPES.items():
            dense, dense_c, int8, int8_torch, weight_values, weight_scales, packed = layers(in_features, out_features)
            weight_t, onednn_weight = weight_values.t(), pack_int8_for_avx2(weight_values)
            zero_points = torch.zeros(out_features, dtype=torch.long)
            if amx:
                without_amx = cpu_int8_kernel.pack_weight(weight_values, cpu_int8_kernel.WITHOUT_AMX)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                values, _ = quantize_rows(x, "int8")
                shifted = quantize_rows(x, "int8", INT7_MAX)[0].add_(64).view(torch.uint8)
                times = {
                    "float32": seconds(lambda: dense(x), args.repeat),
                    "float32_c": seconds(lambda: dense_c(x), args.repeat),
                    "int8": seconds(lambda: int8(x), args.repeat),
                    "int8_torch_backend": seconds(lambda: int8_torch(x), args.repeat),
                    **({"int8_c_kernel_alone": seconds(lambda: cpu_int8_kernel.linear(
                        x, int8.packed_weight, int8.compensation, int8.weight_scale, None), args.repeat),
                        "int8_without_amx": seconds(lambda: cpu_int8_kernel.linear(
                            x, *without_amx, weight_scales, None, None, cpu_int8_kernel.WITHOUT_AMX), args.repeat)}
                       if amx else {}),
                    "int_mm_alone": seconds(lambda: torch._int_mm(values, weight_t), args.repeat),
                    "onednn_u8s8_alone": seconds(lambda: torch.ops.onednn.qlinear_pointwise(
                        shifted, 1.0, 64, onednn_weight, weight_scales, zero_points, None, 1.0, 0, torch.float32,
                        "none", [], ""), args.repeat),
                    "fbgemm_dynamic": seconds(lambda: torch.ops.quantized.linear_dynamic(x, packed, False),
                                              args.repeat),
                }
                flops = 2 * rows * in_features * out_features
                row = {"layer": name, "rows": rows, "in": in_features, "out": out_features,
                       **{f"{k}_gflops": flops / t / 1e9 for k, t in times.items()},
                       "int8_vs_float32_c": times["float32_c"] / times["int8"],
                       **({"amx_vs_without": times["int8_without_amx"] / times["int8_c_kernel_alone"]} if amx else {})}
                results.append(row)
                amx_column = (f"{row['int8_c_kernel_alone_gflops']:.0f} / {row['int8_without_amx_gflops']:.0f} "
                              f"({row['amx_vs_without']:.2f}x)") if amx else "-"
                print(f"| {name} [{in_features} x {out_features}] | {rows} | {row['float32_gflops']:.0f} | "
                      f"{row['float32_c_gflops']:.0f} | {row['int8_gflops']:.0f} | "
                      f"{row['int8_torch_backend_gflops']:.0f} | {row['int8_vs_float32_c']:.2f}x | "
                      f"{amx_column} | {row['int_mm_alone_gflops']:.0f} | {row['onednn_u8s8_alone_gflops']:.0f} | "
                      f"{row['fbgemm_dynamic_gflops']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "int8_dot_product": vnni,
                       "int8_kernel_uses_amx": amx, "results": results}, f, indent=2)
        print(f"[linear] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
