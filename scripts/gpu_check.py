#!/usr/bin/env python3
"""The GPU check: the decode kernel against the torch path, and decode throughput of a GLM-4-9B-shaped model.

    python3 scripts/gpu_check.py --json gpu_check.json        # on a CUDA machine, about two minutes
    TRITON_INTERPRET=1 python3 scripts/gpu_check.py --smoke   # tiny shapes on the CPU (the tests run this)

It prints what it measures and writes JSON:
  1. kernel: the Triton-language paged decode kernel against attention.py's torch path, on random block layouts
     with GLM-4-9B's heads (32 query heads, 2 KV heads, head_dim 128, blocks of 16), in float32 and bfloat16;
  2. bandwidth: device-to-device copy of a large tensor, bytes read plus written per second;
  3. decode: one decode step of a GLM-4-9B-shaped model (random bf16 weights, 9.4B parameters) at each batch
     size, every sequence with --context tokens in the paged cache. Tokens/s are batch / step time, against the
     bandwidth limit: the step has to read all weights and every sequence's keys and values once, so it cannot
     take less than those bytes over the measured bandwidth. The step is the model alone (no scheduling or
     sampling), timed eagerly and replayed from a CUDA graph, which tells where CUDA graphs pay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "backends", "python_glm"))

from glm_engine.attention import AttentionMetadata, _decode_attention  # noqa: E402
from glm_engine.config import ModelConfig  # noqa: E402
from glm_engine.glm_model import GlmForCausalLM  # noqa: E402

# THUDM/glm-4-9b-chat-hf's config.json, the parts the forward pass reads.
GLM4_9B = dict(model_type="glm", vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
               num_attention_heads=32, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5,
               rms_norm_eps=1.5625e-07, attention_bias=True)
TINY = dict(GLM4_9B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


class Timer:
    """Wall time of what runs between start() and stop(), waiting for the device on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, run, repeats: int) -> float:
        """Seconds per call of run(), after one warm-up call."""
        run()
        self.sync()
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        self.sync()
        return (time.perf_counter() - started) / repeats


def random_decode_batch(num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_context, device, dtype, seed):
    """One decode step on a random, fragmented block layout (tests/test_triton_kernel.py uses it too)."""
    generator = torch.Generator().manual_seed(seed)
    context_lens = torch.randint(1, max_context + 1, (num_seqs,), generator=generator)
    max_blocks = -(-int(context_lens.max()) // block_size)
    num_blocks = num_seqs * max_blocks + 7
    # Distinct blocks in a random order, as a fragmented pool would give them.
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks].view(num_seqs, max_blocks)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return (randn(num_seqs, num_heads, head_dim), randn(num_blocks, block_size, num_kv_heads, head_dim),
            randn(num_blocks, block_size, num_kv_heads, head_dim), tables.to(device), context_lens.to(device))


def check_kernel(device: torch.device, smoke: bool) -> list[dict]:
    from glm_engine.triton_attention import paged_decode_attention

    shapes = [(4, 4, 2, 16, 4, 40)] if smoke else [(64, 32, 2, 128, 16, 4096), (7, 32, 2, 128, 16, 300)]
    dtypes = [torch.float32] if smoke else [torch.float32, torch.bfloat16]
    results = []
    for seed, (num_seqs, heads, kv_heads, head_dim, block_size, max_context) in enumerate(shapes):
        for dtype in dtypes:
            q, k_cache, v_cache, tables, context_lens = random_decode_batch(
                num_seqs, heads, kv_heads, head_dim, block_size, max_context, device, dtype, seed)
            scale = head_dim ** -0.5
            got = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale).float()
            # The reference runs in float32 on the same (rounded) inputs.
            expected = _decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, context_lens, scale)
            error = (got - expected).abs().max().item()
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            results.append({"seqs": num_seqs, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                            "block_size": block_size, "max_context": max_context, "dtype": str(dtype),
                            "max_abs_error": error, "tolerance": tolerance, "ok": error <= tolerance})
            print(f"[kernel] {results[-1]}", flush=True)
    return results


def measure_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes read plus written per second by a device-to-device copy."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    seconds = Timer(device).time(lambda: target.copy_(source), repeats=10)
    bandwidth = 2 * source.numel() * 4 / seconds
    print(f"[bandwidth] {bandwidth / 1e9:.0f} GB/s (copy of {megabytes} MiB)", flush=True)
    return bandwidth


def build_random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> GlmForCausalLM:
    """Random weights with the checkpoint's names and shapes, loaded as a checkpoint would be."""
    with torch.device("meta"):
        model = GlmForCausalLM(config)
    generator = torch.Generator(device=device).manual_seed(0)
    state = {name: (torch.ones(p.shape, device=device, dtype=dtype) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=generator, device=device, dtype=dtype) * 0.02)
             for name, p in model.state_dict().items()}
    model.load_weights(state)
    return model.eval()


def decode_inputs(config: ModelConfig, batch: int, context: int, block_size: int, device: torch.device):
    """A decode step for `batch` sequences that each hold `context` tokens, in blocks laid out one after another."""
    blocks_per_seq = -(-(context + 1) // block_size)
    tables = torch.arange(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq)
    positions = torch.full((batch,), context, device=device)
    slots = tables[:, context // block_size] * block_size + context % block_size
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             context_lens=torch.full((batch,), context + 1, device=device),
                             query_lens=[1] * batch, host_context_lens=[context + 1] * batch,
                             use_decode_kernel=device.type == "cuda")
    input_ids = torch.randint(0, config.vocab_size, (batch,), device=device)
    return input_ids, positions, meta, batch * blocks_per_seq


def measure_decode(config: ModelConfig, batches: list[int], context: int, device: torch.device, dtype: torch.dtype,
                   bandwidth: float, repeats: int) -> list[dict]:
    model = build_random_model(config, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"[decode] model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
          f"{weight_bytes / 1e9:.1f} GB", flush=True)
    block_size, timer = 16, Timer(device)
    results = []
    for batch in batches:
        input_ids, positions, meta, num_blocks = decode_inputs(config, batch, context, block_size, device)
        kv_cache = torch.randn(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                               device=device, dtype=dtype)
        kv_caches = [(layer[0], layer[1]) for layer in kv_cache]

        @torch.inference_mode()
        def step():
            return model.logits(model(input_ids, positions, kv_caches, meta))

        eager = timer.time(step, repeats)
        graphed = None
        if device.type == "cuda":
            graphed = timer.time(capture(step), repeats)
        # Weights once, plus each sequence's keys and values (the new token's are written, not read).
        kv_bytes = batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize
        floor = (weight_bytes + kv_bytes) / bandwidth
        best = min(t for t in (eager, graphed) if t is not None)
        results.append({"batch": batch, "context": context, "step_ms_eager": eager * 1e3,
                        "step_ms_cuda_graph": None if graphed is None else graphed * 1e3,
                        "tokens_per_s": batch / best, "bandwidth_limit_tokens_per_s": batch / floor,
                        "fraction_of_bandwidth_limit": floor / best,
                        "bytes_per_step_gb": (weight_bytes + kv_bytes) / 1e9})
        print(f"[decode] {results[-1]}", flush=True)
        del kv_cache, kv_caches
    return results


def capture(step):
    """step() recorded into a CUDA graph, after a warm-up on a side stream; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the script itself")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024, help="tokens each sequence holds in the cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --smoke runs tiny shapes on the CPU")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on the CPU the kernel runs only under TRITON_INTERPRET=1")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[gpu_check] {name}, torch {torch.__version__}", flush=True)

    config = ModelConfig.from_dict(TINY if args.smoke else GLM4_9B)
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        batches, args.context, args.repeats = [1, 2], 24, 2
    results = {"device": name, "torch": torch.__version__, "kernel": check_kernel(device, args.smoke)}
    results["bandwidth_bytes_per_s"] = measure_bandwidth(device, 8 if args.smoke else 4096)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    results["decode"] = measure_decode(config, batches, args.context, device, dtype,
                                       results["bandwidth_bytes_per_s"], args.repeats)

    print("\n| batch | eager ms | CUDA graph ms | tokens/s | bandwidth limit tokens/s | of limit |\n|---|---|---|---|---|---|")
    for row in results["decode"]:
        graph = "-" if row["step_ms_cuda_graph"] is None else f"{row['step_ms_cuda_graph']:.2f}"
        print(f"| {row['batch']} | {row['step_ms_eager']:.2f} | {graph} | {row['tokens_per_s']:.0f} | "
              f"{row['bandwidth_limit_tokens_per_s']:.0f} | {row['fraction_of_bandwidth_limit'] * 100:.0f}% |")
    kernel_ok = all(check["ok"] for check in results["kernel"])
    print(f"kernel against the torch path: {'ok' if kernel_ok else 'MISMATCH'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"[gpu_check] wrote {args.json}")
    return 0 if kernel_ok else 1


if __name__ == "__main__":
    sys.exit(main())
