"""Tensors in, logits out: loads the model, owns the KV cache tensor and runs one step of the batch.

A step is first described as plain lists (StepInputs, from the scheduler's SchedulerOutput), then run. With tensor
parallelism, rank 0's runner sends each step's StepInputs to the other ranks' runners (glm_engine/tp_workers.py),
which run it with their part of the model: the description is the only thing that crosses processes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import cpu_int8_kernel
from .attention import AttentionMetadata
from .checkpoint import load_state_dict, stored_precision
from .config import EngineConfig, ModelConfig
from .cuda_graph import DecodeGraphs, graph_batch_sizes
from .glm_model import GlmForCausalLM
from .host_allocator import keep_freed_memory
from .memory import RESERVE_BYTES, available_bytes, check_fits, weight_bytes
from .quantization import int8_cpu_kernel, resolve_method
from .scheduler import SchedulerOutput
from .tensor_parallel import Shard

log = logging.getLogger(__name__)


class FatalEngineError(RuntimeError):
    """The engine cannot go on: a tensor-parallel rank died, or a step failed once the other ranks had started it (they
    wait in a collective this rank will not reach). Only a new engine, in a new process, can serve again."""


def resolve_device(name: str, shard: Shard = Shard()) -> torch.device:
    """`auto`: CUDA when there is a GPU, else the CPU. Rank r of a tensor-parallel engine takes the r-th GPU from
    the one named (cuda, cuda:0: GPUs 0 .. N-1; cuda:2: GPUs 2 .. N+1)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    index, count = (device.index or 0) + shard.rank, torch.cuda.device_count()
    if index >= count:
        who = f"rank {shard.rank} of tensor_parallel_size {shard.world_size}" if shard.world_size > 1 else "it"
        raise ValueError(f"device {name!r}: {who} needs GPU {index}, and this machine has {count}")
    return torch.device("cuda", index)


def cpu_threads(config: EngineConfig, shard: Shard) -> int:
    """Threads for torch on the CPU: cpu_threads, else (with tensor parallelism) the cores shared out between the
    ranks, which run at once; 0 leaves torch's default."""
    if config.cpu_threads or shard.world_size == 1:
        return config.cpu_threads
    return max(1, len(os.sched_getaffinity(0)) // shard.world_size)


def choose_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """What attends decode rows (AttentionMetadata.decode_kernel). auto: the Triton-language kernel on CUDA, the C
    kernel on the CPU in float32, each where it can run, else torch. Asked for by name, a kernel that cannot run
    here is an error."""
    if backend == "torch":
        return "torch"
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        try:
            import triton  # noqa: F401
        except ImportError:
            if backend == "triton":
                raise ValueError("attention_backend triton: the triton package is not installed") from None
            log.warning("triton is not installed: decode attention uses the torch path")
            return "torch"
        return "triton"
    if device.type != "cpu" or dtype != torch.float32:
        if backend == "cpu":
            raise ValueError(f"attention_backend cpu: the C kernel runs float32 on the CPU, not {dtype} on {device}")
        return "torch"
    from . import cpu_decode_kernel, cpu_prefill_kernel

    def load_both():
        cpu_decode_kernel.load()
        cpu_prefill_kernel.load()

    return _c_kernel_or(load_both, "torch", backend, "attention_backend", "attention uses the torch path")


def _c_kernel_or(load, fallback: str, backend: str, parameter: str, consequence: str) -> str:
    """Returns "cpu" where the C kernel that `load` builds can run. Where it cannot: the fallback, logging why
    (backend auto), or an error naming the parameter (backend cpu)."""
    from .c_kernels import KernelUnavailable

    try:
        load()
    except KernelUnavailable as exc:
        if backend == "cpu":
            raise ValueError(f"{parameter} cpu: {exc}") from None
        log.warning("a C kernel is not available (%s): %s", exc, consequence)
        return fallback
    return "cpu"


def choose_layer_kernels(backend: str, device: torch.device, dtype: torch.dtype,
                         quantization: str = "none") -> str | None:
    """What runs the decoder layers' work on the CPU (GlmForCausalLM.load_weights): "cpu" (the C kernels: float
    products, norms, SiLU * up, and int8 products: quantization.int8_cpu_kernel) or "torch"; None on CUDA. auto:
    the C kernels in float32 where all those the model needs build. "cpu" where they cannot run is an error."""
    if device.type != "cpu":
        if backend == "cpu":
            raise ValueError(f"layer_backend cpu: the C kernels run on the CPU, not on {device}")
        return None
    if backend == "torch":
        return "torch"
    if dtype != torch.float32:
        if backend == "cpu":
            raise ValueError(f"layer_backend cpu: the C kernels run float32, not {dtype}")
        return "torch"
    from . import cpu_elementwise_kernel, cpu_linear_kernel

    def load_all():
        cpu_linear_kernel.load()
        cpu_elementwise_kernel.load()
        if quantization == "int8":
            cpu_int8_kernel.load()

    return _c_kernel_or(load_all, "torch", backend, "layer_backend", "the layers use oneDNN and torch")


def describe_int8_path(layer_kernels: str) -> str:
    """For the log at load: what runs int8 products on this CPU (quantization.int8_cpu_kernel)."""
    kernel = int8_cpu_kernel(layer_kernels)
    if kernel == "cpu":
        kernel = cpu_int8_kernel.load()
        return (f"the C kernel{' (AMX tiles)' if kernel.uses_amx else ''}, weights and activations within "
                f"+-{kernel.value_max}")
    if kernel == "onednn":
        return "oneDNN's uint8 x int8 product, 7-bit activations: about float32's speed without VNNI"
    return "torch._int_mm"


def decode_graphs_wanted(config: EngineConfig, device: torch.device, decode_kernel: str, shard: Shard) -> bool:
    """Recording needs CUDA and the Triton decode kernel (the torch path reads context lengths on the host). Not with
    tensor parallelism yet: every rank would have to replay its graph in step, collectives included."""
    return (config.cuda_graph_max_batch > 0 and device.type == "cuda" and decode_kernel == "triton"
            and shard.world_size == 1)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


@dataclass
class StepInputs:
    """One step as plain lists: what the forward pass needs, and what rank 0 sends the other ranks."""

    input_ids: list[int]  # the new tokens of every scheduled sequence, in batch order
    positions: list[int]
    slots: list[int]  # the KV slot (block * block_size + offset) each new token writes
    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # tokens in each sequence's cache after the step
    block_tables: list[list[int]]
    sample_rows: list[int]  # the rows whose logits are wanted: each sampling sequence's last new token

    @classmethod
    def from_step(cls, step: SchedulerOutput, block_size: int) -> "StepInputs":
        inputs = cls([], [], [], [], [], [], [])
        for item in step.scheduled:
            seq, start, count = item.seq, item.start, item.num_new_tokens
            inputs.input_ids += seq.token_ids[start:start + count]
            for pos in range(start, start + count):
                inputs.positions.append(pos)
                inputs.slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
            inputs.query_lens.append(count)
            inputs.context_lens.append(start + count)
            inputs.block_tables.append(seq.block_table)
            if item.samples:
                inputs.sample_rows.append(len(inputs.input_ids) - 1)
        return inputs


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int, shard: Shard = Shard()):
        """shard: the part of the model this runner holds (tensor parallelism; by default the whole). Rank 0's
        runner then also sends each step to the others (execute); theirs run what it sends (run)."""
        self.model_config = model_config
        self.block_size = config.block_size
        self.shard = shard
        self.device = resolve_device(config.device, shard)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.decode_kernel = choose_decode_kernel(config.attention_backend, self.device, self.dtype)
        stored = stored_precision(config.model_dir).method
        self.quantization = resolve_method(config.quantization, stored, self.device)
        if config.quantize_lm_head and self.quantization == "none":
            served_in = str(self.dtype).removeprefix("torch.")
            raise ValueError("quantize_lm_head needs the projections in 8 bits: quantization int8 or fp8 (or an FP8 "
                             f"checkpoint served in FP8), but they are served in {served_in}")
        self.layer_kernels = choose_layer_kernels(config.layer_backend, self.device, self.dtype, self.quantization)
        if threads := cpu_threads(config, shard):
            torch.set_num_threads(threads)
        if self.device.type == "cpu":
            keep_freed_memory()
        if self.quantization == "int8" and self.device.type == "cpu":
            log.info("int8 products on this CPU: %s (docs/quantization.md)", describe_int8_path(self.layer_kernels))
        if stored == "fp8" and config.quantization == "auto" and self.quantization == "none":
            log.warning("the FP8 checkpoint %s is served in %s: %s has no FP8 matmuls (quantization int8 keeps the "
                        "weights in 8 bits)", config.model_dir, self.dtype, self.device)

        # Built on the meta device so no memory is spent on random initial weights, then filled from the files.
        with torch.device("meta"):
            self.model = GlmForCausalLM(model_config, self.quantization, shard, config.quantize_lm_head)
        # Named before load_weights fuses q/k/v: the checkpoint's names (the memory check counts them too).
        self.quantized_weight_names = self.model.quantized_weight_names()
        self._check_memory(config, self.quantized_weight_names)
        shard.barrier()  # no rank loads before every rank (on the CPU, rank 0 for all) has found room
        split = (lambda name, tensor: shard.split(name, tensor, model_config)) if shard.world_size > 1 else None
        self.model.load_weights(
            load_state_dict(config.model_dir, self.dtype, self.device, self.quantized_weight_names,
                            self.quantization, split),
            cpu_kernels=self.layer_kernels)
        self.model.eval()

        use_graphs = decode_graphs_wanted(config, self.device, self.decode_kernel, shard)
        # Every rank's pool has the same blocks (rank 0's block tables hold on all): the smallest that fits on each.
        self.num_blocks = config.num_kv_blocks or shard.min_over_ranks(self._blocks_that_fit(config) - use_graphs)
        # [layers, k/v, blocks, block_size, kv_heads, head_dim]. Zeroed: masked slots must never hold NaN.
        # With CUDA graphs, one more block than the pool's: the scratch block that padding rows write to.
        kv_cache = torch.zeros(
            model_config.num_layers, 2, self.num_blocks + use_graphs, self.block_size,
            shard.num_kv_heads(model_config), model_config.head_dim, dtype=self.dtype, device=self.device,
        )
        # Each layer's (keys, values): views of the one tensor.
        self.kv_caches = [(layer[0], layer[1]) for layer in kv_cache]
        self.decode_graphs = None
        if use_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, graph_batch_sizes(min(config.cuda_graph_max_batch, config.max_num_seqs)),
                max_blocks_per_seq=-(-max_model_len // self.block_size), scratch_block=self.num_blocks,
                block_size=self.block_size, device=self.device, decode_kernel=self.decode_kernel,
                record=self.device.type == "cuda")
        rank = f"rank {shard.rank} of {shard.world_size}: " if shard.world_size > 1 else ""
        log.info("%smodel on %s (%s, quantization %s), KV cache %d blocks of %d tokens (%.1f MiB), decode attention: "
                 "%s", rank, self.device, self.dtype, self.quantization, self.num_blocks, self.block_size,
                 kv_cache.numel() * kv_cache.element_size() / 2**20,
                 {"triton": "Triton kernel", "cpu": "C kernel"}.get(self.decode_kernel, "torch"))

    def bytes_per_block(self) -> int:
        """KV bytes a block takes on this rank (its KV heads)."""
        mc = self.model_config
        kv_heads = self.shard.num_kv_heads(mc)
        return 2 * mc.num_layers * self.block_size * kv_heads * mc.head_dim * self.dtype.itemsize

    def _check_memory(self, config: EngineConfig, quantized: set[str]) -> None:
        """Before anything is loaded: refuse an engine that cannot fit beside what runs already (InsufficientMemory).
        On CUDA an engine takes gpu_memory_utilization of the device's memory (weights, KV cache, activations), so two
        versions fit on one GPU when their shares do; on the CPU, its weights and kv_cache_memory_mb. With tensor
        parallelism each rank checks its own GPU; on the CPU, where the ranks share the memory, rank 0 checks them all
        (each holds about its share of the weights: it counts its own, times the ranks)."""
        shard = self.shard
        what = f"the engine for {config.model_dir} on {self.device}"
        kv_bytes = config.num_kv_blocks * self.bytes_per_block() if config.num_kv_blocks else None
        if self.device.type == "cuda" and kv_bytes is None:
            total = torch.cuda.mem_get_info(self.device)[1]
            share = int(total * config.gpu_memory_utilization)
            check_fits(what, {f"gpu_memory_utilization {config.gpu_memory_utilization:g}": share},
                       available_bytes(self.device), reserve=0)
            return
        if self.device.type == "cpu" and shard.rank > 0:
            return
        ranks = shard.world_size if self.device.type == "cpu" else 1
        if ranks > 1:
            what += f" ({ranks} tensor-parallel ranks)"
        shape_of = (lambda name, shape: shard.split_shape(name, shape, self.model_config)
                    ) if shard.world_size > 1 else None  # this rank's part (on CUDA, with num_kv_blocks, too)
        weights = weight_bytes(config.model_dir, self.dtype, quantized, shape_of) * ranks
        kv_bytes = kv_bytes * ranks if kv_bytes is not None else config.kv_cache_memory_mb * 2**20
        check_fits(what, {"weights": weights, "KV cache": kv_bytes}, available_bytes(self.device))

    def _blocks_that_fit(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            # This engine's share of the device, less what it holds already (its weights), less room for
            # activations; never more than is free (another version's engine may run beside it).
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(int(total * config.gpu_memory_utilization) - torch.cuda.memory_reserved(self.device),
                         free) - RESERVE_BYTES
        else:  # the ranks share the CPU's memory, and the budget: each takes its share
            budget = config.kv_cache_memory_mb * 2**20 // self.shard.world_size
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB budget); "
                             "raise kv_cache_memory_mb / gpu_memory_utilization or set num_kv_blocks")
        return num_blocks

    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Run one step (on every rank). Returns float32 logits [sequences that sample, vocab], in batch order."""
        inputs = StepInputs.from_step(step, self.block_size)
        if self.shard.world_size == 1:
            return self.run(inputs)
        try:
            self.shard.broadcast(inputs)
            return self.run(inputs)
        except Exception as exc:  # the other ranks may have begun the step: they cannot be brought back in step
            log.exception("a tensor-parallel step failed on rank 0")
            raise FatalEngineError("a tensor-parallel step failed after the other ranks began it") from exc

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run one step on this rank's part of the model: logits [sample rows, vocab] on rank 0, None elsewhere."""
        tables, context_lens = inputs.block_tables, inputs.context_lens
        graphs = self.decode_graphs
        if graphs is not None and len(tables) == len(inputs.input_ids) <= graphs.max_batch:  # one token a sequence
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.slots, tables, context_lens)
            # Row b is sequence b; a one-token prompt chunk that is not the prompt's last does not sample.
            return logits if len(inputs.sample_rows) == len(tables) else logits[inputs.sample_rows]

        max_blocks = max(len(t) for t in tables)
        padded_tables = [t + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(inputs.slots),
            block_tables=tensor(padded_tables),
            context_lens=tensor(context_lens),
            query_lens=inputs.query_lens,
            host_context_lens=context_lens,
            decode_kernel=self.decode_kernel,
        )
        hidden = self.model(tensor(inputs.input_ids), tensor(inputs.positions), self.kv_caches, meta)
        return self.model.logits(hidden[tensor(inputs.sample_rows)])
