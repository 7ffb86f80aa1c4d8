"""The GPU check: the decode kernel against the torch path, and decode throughput of a GLM-4-9B-shaped model.

    python3 scripts/gpu_check.py --json gpu_check.json        # on a CUDA machine, two to three minutes
    TRITON_INTERPRET=1 python3 scripts/gpu_check.py --smoke   # tiny shapes on the CPU (the tests run this)

It needs glm_engine and glm_tools importable: installed (scripts/setup_env.sh), or with
PYTHONPATH=backends/python_glm:. from the repository root on a machine where nothing is installed.

It prints what it measures and writes JSON:
  1. kernel: the Triton-language paged decode kernel against attention.py's torch path, on random block layouts
     with GLM-4-9B's heads (32 query heads, 2 KV heads, head_dim 128, blocks of 16), in float32 and bfloat16;
  2. bandwidth: device-to-device copy of a large tensor, bytes read plus written per second;
  3. decode: one decode step of a GLM-4-9B-shaped model (random bf16 weights, 9.4B parameters; then the same
     with the engine's int8 and fp8 quantization, glm_engine/quantization.py) at each batch size, every sequence
     with --context tokens in the paged cache. Tokens/s are batch / step time, against bf16's and against the
     bandwidth limit: the step has to read all weights and every sequence's keys and values once, so it cannot
     take less than those bytes over the measured bandwidth. The step is the model alone (no scheduling or
     sampling), timed eagerly and replayed from the engine's CUDA graphs (glm_engine/cuda_graph.py, inputs copied
     from host lists as the engine does), which tells where CUDA graphs pay; replayed logits must match eager
     ones;
  4. engine: the whole engine on a small random GLM-4 checkpoint, with its CUDA graphs and without (greedy tokens
     must agree), and the output tokens/s of each;
  5. sampler: one call of the engine's sampler on GLM-4-9B's vocabulary at each batch size, greedy and with
     GLM-4's default settings, on peaked and flat random logits (as scripts/bench_sampler.py does on the CPU), to
     set against the decode step;
  6. two versions: two engines with gpu_memory_utilization 0.4 fit on one GPU and a third is refused before it
     loads anything (the memory rule of a rollout, docs/versions.md);
  7. tensor parallelism, on a machine with two GPUs or more: the small GLM-4 on 1, 2, 4 and 8 GPUs (as many as
     there are) over NCCL, float32, greedy tokens and first-step logits against one GPU's, output tokens/s of each
     (the smoke run does 1 and 2 ranks over gloo on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from glm_engine.attention import AttentionMetadata, _decode_attention
from glm_engine.checkpoint import place_tensors
from glm_engine.config import ModelConfig
from glm_engine.cuda_graph import DecodeGraphs
from glm_engine.glm_model import GlmForCausalLM

# THUDM/glm-4-9b-chat-hf's config.json, the parts the forward pass reads.
GLM4_9B = dict(model_type="glm", vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
               num_attention_heads=32, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5,
               rms_norm_eps=1.5625e-07, attention_bias=True)
# A small GLM-4 for the engine check: small enough that launch overhead, which CUDA graphs remove, shows.
SMALL_GLM4 = dict(GLM4_9B, model_type="glm4", vocab_size=4096, hidden_size=512, intermediate_size=1376,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
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
    from glm_engine.paged_decode_kernel import paged_decode_attention

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


def random_checkpoint_state(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """Random weights under the checkpoint's names and shapes."""
    with torch.device("meta"):
        names_and_shapes = {name: p.shape for name, p in GlmForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(0)
    return {name: (torch.ones(shape, device=device, dtype=dtype) if name.endswith("norm.weight")
                   else torch.randn(shape, generator=generator, device=device, dtype=dtype) * 0.02)
            for name, shape in names_and_shapes.items()}


def build_random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                       quantization: str = "none") -> GlmForCausalLM:
    """Random weights, loaded (and quantized) as a checkpoint's would be."""
    with torch.device("meta"):
        model = GlmForCausalLM(config, quantization)
    state = random_checkpoint_state(config, device, dtype)
    model.load_weights(place_tensors(state.items(), dtype, device, model.quantized_weight_names(), quantization))
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
                             decode_kernel="triton" if device.type == "cuda" else "torch")
    input_ids = torch.randint(0, config.vocab_size, (batch,), device=device)
    return input_ids, positions, meta, batch * blocks_per_seq


def measure_decode(config: ModelConfig, batches: list[int], context: int, device: torch.device, dtype: torch.dtype,
                   bandwidth: float, repeats: int, quantization: str = "none") -> list[dict]:
    model = build_random_model(config, device, dtype, quantization)
    tensors = [*model.parameters(), *model.buffers()]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"[decode] model ({quantization}): {sum(t.numel() for t in tensors) / 1e9:.2f}B values, "
          f"{weight_bytes / 1e9:.1f} GB", flush=True)
    block_size, timer = 16, Timer(device)
    results = []
    for batch in batches:
        input_ids, positions, meta, num_blocks = decode_inputs(config, batch, context, block_size, device)
        # One block more than the sequences use: the scratch block of the graphs' padding rows.
        kv_cache = torch.randn(config.num_layers, 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim,
                               device=device, dtype=dtype)
        kv_caches = [(layer[0], layer[1]) for layer in kv_cache]

        @torch.inference_mode()
        def step():
            return model.logits(model(input_ids, positions, kv_caches, meta))

        eager = timer.time(step, repeats)
        # The engine's own CUDA graphs (glm_engine/cuda_graph.py), fed from host lists as the engine feeds them.
        graphs = DecodeGraphs(model, kv_caches, [batch], max_blocks_per_seq=meta.block_tables.shape[1],
                              scratch_block=num_blocks, block_size=block_size, device=device,
                              decode_kernel=meta.decode_kernel, record=device.type == "cuda")
        host_inputs = (input_ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(), meta.block_tables.tolist(),
                       meta.host_context_lens)

        @torch.inference_mode()
        def graph_step():
            return graphs.run(*host_inputs)

        # Same kernels on the same shapes: replayed logits must equal eager ones but for rounding.
        expected, got = step(), graph_step()
        graph_error = ((got - expected).abs().max() / expected.abs().max()).item()
        graphed = timer.time(graph_step, repeats) if device.type == "cuda" else None
        # Weights once, plus each sequence's keys and values (the new token's are written, not read).
        kv_bytes = batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize
        floor = (weight_bytes + kv_bytes) / bandwidth
        best = min(t for t in (eager, graphed) if t is not None)
        results.append({"quantization": quantization, "batch": batch, "context": context,
                        "step_ms_eager": eager * 1e3,
                        "step_ms_cuda_graph": None if graphed is None else graphed * 1e3,
                        "graph_vs_eager_relative_error": graph_error, "graph_ok": graph_error <= 1e-2,
                        "tokens_per_s": batch / best, "bandwidth_limit_tokens_per_s": batch / floor,
                        "fraction_of_bandwidth_limit": floor / best,
                        "bytes_per_step_gb": (weight_bytes + kv_bytes) / 1e9})
        print(f"[decode] {results[-1]}", flush=True)
        del kv_cache, kv_caches, graphs
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def check_engine(raw_config: dict, device: torch.device, num_prompts: int, max_tokens: int) -> dict:
    """The whole engine on a random checkpoint written to disk, float32, with its CUDA graphs and without: greedy
    tokens must agree, and the output tokens/s of each run tell what the graphs give a real decode loop.
    (On the CPU nothing is recorded, so both runs are eager: the smoke run checks only the script.)"""
    from glm_engine import EngineConfig, LLMEngine, SamplingParams

    prompts = random_prompts(raw_config["vocab_size"], num_prompts, seed=3)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=())  # no end token: every prompt runs to the end
    runs = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(raw_config, model_dir)
        for label, graph_batch in (("eager", 0), ("cuda_graphs", 64)):
            engine = LLMEngine(EngineConfig(model_dir=model_dir, device=device.type, dtype="float32",
                                            num_kv_blocks=num_prompts * 32, max_num_seqs=num_prompts,
                                            cuda_graph_max_batch=graph_batch))
            engine.generate(prompts[:2], SamplingParams(max_tokens=4, stop_token_ids=()))  # warm-up
            started = time.perf_counter()
            tokens = engine.generate(prompts, params)
            seconds = time.perf_counter() - started
            runs[label] = {"tokens": tokens, "output_tokens_per_s": sum(map(len, tokens)) / seconds,
                           "graphs_recorded": engine.runner.decode_graphs is not None}
            del engine
    result = {"prompts": num_prompts, "max_tokens": max_tokens,
              "tokens_equal": runs["eager"]["tokens"] == runs["cuda_graphs"]["tokens"],
              **{f"{label}_{key}": value for label, run in runs.items() for key, value in run.items()
                 if key != "tokens"}}
    print(f"[engine] {result}", flush=True)
    return result


def random_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 8-200 random tokens, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 200, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def write_random_checkpoint(raw_config: dict, model_dir: str) -> None:
    from safetensors.torch import save_file

    state = random_checkpoint_state(ModelConfig.from_dict(raw_config), torch.device("cpu"), torch.float32)
    save_file(state, os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(raw_config, f)


def check_two_versions(raw_config: dict, device: torch.device) -> dict:
    """The memory rule of a rollout (docs/versions.md): on CUDA, two engines with gpu_memory_utilization 0.4 each fit
    side by side on one GPU and a third is refused before it loads anything; on the CPU (smoke), an engine whose KV
    pool is larger than the free memory is refused."""
    from glm_engine import EngineConfig, LLMEngine
    from glm_engine.memory import InsufficientMemory, available_bytes

    if device.type == "cuda":
        share = {"gpu_memory_utilization": 0.4}
        budgets = [share, share, share]
    else:
        budgets = [{"kv_cache_memory_mb": 16}, {"kv_cache_memory_mb": available_bytes(device) // 2**20 + 1024}]
    engines, blocks, refusal = [], [], None
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(raw_config, model_dir)
        for budget in budgets:
            try:
                engines.append(LLMEngine(EngineConfig(model_dir=model_dir, device=device.type, dtype="float32",
                                                      cuda_graph_max_batch=0, **budget)))
                blocks.append(engines[-1].runner.num_blocks)
            except InsufficientMemory as exc:
                refusal = str(exc)
                break
    result = {"engines_started": len(engines), "kv_blocks": blocks, "refusal": refusal,
              "ok": len(engines) == len(budgets) - 1 and refusal is not None}
    del engines
    print(f"[two versions] {result}", flush=True)
    return result


def check_tensor_parallel(raw_config: dict, device: torch.device, num_prompts: int, max_tokens: int) -> dict:
    """The engine on 1, 2, 4, 8 ranks (as many GPUs as there are; 2 ranks over gloo on the CPU): greedy tokens must
    equal one rank's and the first step's logits lie within 1e-3 of them; output tokens/s of each size."""
    from glm_engine import EngineConfig, LLMEngine, SamplingParams

    available = torch.cuda.device_count() if device.type == "cuda" else 2
    sizes = [n for n in (1, 2, 4, 8) if n <= available and raw_config["num_attention_heads"] % n == 0]
    if len(sizes) == 1:
        result = {"sizes": sizes, "skipped": f"{available} GPU: tensor parallelism needs two", "ok": True}
        print(f"[tensor parallel] {result}", flush=True)
        return result
    prompts = random_prompts(raw_config["vocab_size"], num_prompts, seed=4)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=())
    runs = []
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(raw_config, model_dir)
        for size in sizes:
            engine = LLMEngine(EngineConfig(model_dir=model_dir, device=device.type, dtype="float32",
                                            num_kv_blocks=num_prompts * 32, max_num_seqs=num_prompts,
                                            cuda_graph_max_batch=0, tensor_parallel_size=size))
            try:
                engine.generate(prompts[:2], SamplingParams(max_tokens=4, stop_token_ids=()))  # warm-up, as above
                execute, first_logits = engine.runner.execute, []

                def recording_execute(step, execute=execute, first_logits=first_logits):
                    logits = execute(step)
                    if not first_logits:
                        first_logits.append(logits.cpu())
                    return logits

                engine.runner.execute = recording_execute
                started = time.perf_counter()
                tokens = engine.generate(prompts, params)
                seconds = time.perf_counter() - started
            finally:
                engine.close()
            runs.append({"ranks": size, "tokens": tokens, "logits": first_logits[0],
                         "output_tokens_per_s": sum(map(len, tokens)) / seconds})
    rows = [{"ranks": run["ranks"], "output_tokens_per_s": run["output_tokens_per_s"],
             "vs_one_rank": run["output_tokens_per_s"] / runs[0]["output_tokens_per_s"],
             "tokens_equal": run["tokens"] == runs[0]["tokens"],
             "max_logit_difference": (run["logits"] - runs[0]["logits"]).abs().max().item()} for run in runs]
    result = {"sizes": sizes, "prompts": num_prompts, "max_tokens": max_tokens, "runs": rows,
              "ok": all(row["tokens_equal"] and row["max_logit_difference"] <= 1e-3 for row in rows)}
    for row in rows:
        print(f"[tensor parallel] {row}", flush=True)
    return result


def measure_sampler(vocab: int, batches: list[int], device: torch.device, repeats: int) -> list[dict]:
    from glm_engine.sampler import sample

    from .sampling_cases import LOGIT_SCALES, SETTINGS, make_sequences

    timer, results = Timer(device), []
    for batch in batches:
        for setting in ("greedy", "GLM-4 default (T 0.8, top_p 0.8)"):
            seqs = make_sequences(batch, SETTINGS[setting], vocab)
            for shape, scale in LOGIT_SCALES.items():
                logits = torch.randn(batch, vocab, device=device) * scale
                ms = timer.time(lambda: sample(logits.clone(), seqs), repeats) * 1e3
                results.append({"batch": batch, "vocab": vocab, "setting": setting, "logits": shape, "ms": ms})
                print(f"[sampler] {results[-1]}", flush=True)
    return results


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
    # bf16 weights, then INT8 and FP8 (native on Hopper, emulated on the CPU and on older GPUs).
    results["decode"] = [row for quantization in ("none", "int8", "fp8")
                         for row in measure_decode(config, batches, args.context, device, dtype,
                                                   results["bandwidth_bytes_per_s"], args.repeats, quantization)]
    results["engine"] = check_engine(TINY if args.smoke else SMALL_GLM4, device, num_prompts=4 if args.smoke else 32,
                                     max_tokens=8 if args.smoke else 128)
    results["sampler"] = measure_sampler(config.vocab_size, batches, device, args.repeats)
    results["two_versions"] = check_two_versions(TINY if args.smoke else SMALL_GLM4, device)
    results["tensor_parallel"] = check_tensor_parallel(TINY if args.smoke else SMALL_GLM4, device,
                                                       num_prompts=4 if args.smoke else 32,
                                                       max_tokens=8 if args.smoke else 128)

    print("\n| weights | batch | eager ms | CUDA graph ms | tokens/s | vs bf16 | bandwidth limit tokens/s | of limit |"
          "\n|---|---|---|---|---|---|---|---|")
    bf16 = {row["batch"]: row["tokens_per_s"] for row in results["decode"] if row["quantization"] == "none"}
    for row in results["decode"]:
        graph = "-" if row["step_ms_cuda_graph"] is None else f"{row['step_ms_cuda_graph']:.2f}"
        row["vs_bf16"] = row["tokens_per_s"] / bf16[row["batch"]]
        print(f"| {row['quantization']} | {row['batch']} | {row['step_ms_eager']:.2f} | {graph} | "
              f"{row['tokens_per_s']:.0f} | {row['vs_bf16']:.2f}x | {row['bandwidth_limit_tokens_per_s']:.0f} | "
              f"{row['fraction_of_bandwidth_limit'] * 100:.0f}% |")
    kernel_ok = all(check["ok"] for check in results["kernel"])
    graphs_ok = all(row["graph_ok"] for row in results["decode"]) and results["engine"]["tokens_equal"]
    engine = results["engine"]
    print(f"engine, {engine['prompts']} prompts x {engine['max_tokens']} tokens: "
          f"{engine['eager_output_tokens_per_s']:.0f} tok/s eager, {engine['cuda_graphs_output_tokens_per_s']:.0f} "
          f"tok/s with CUDA graphs (recorded: {engine['cuda_graphs_graphs_recorded']})")
    print(f"sampler, one call on {config.vocab_size:,} tokens, ms: " + "; ".join(
        f"batch {row['batch']} {row['setting']} {row['logits']} {row['ms']:.2f}" for row in results["sampler"]
        if row["setting"] != "greedy" or row["logits"] == "peaked"))
    memory_ok, parallel_ok = results["two_versions"]["ok"], results["tensor_parallel"]["ok"]
    print(f"kernel against the torch path: {'ok' if kernel_ok else 'MISMATCH'}; "
          f"CUDA graphs against eager steps: {'ok' if graphs_ok else 'MISMATCH'}; "
          f"two versions' memory rule: {'ok' if memory_ok else 'FAILED'}; "
          f"tensor parallelism against one rank: {'ok' if parallel_ok else 'MISMATCH'}"
          f"{' (' + results['tensor_parallel']['skipped'] + ')' if 'skipped' in results['tensor_parallel'] else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"[gpu_check] wrote {args.json}")
    return 0 if kernel_ok and graphs_ok and memory_ok and parallel_ok else 1
