"""Tensors in, logits out: loads the model, owns the KV cache tensor and runs one step of the batch."""

from __future__ import annotations

import logging

import torch

from .attention import AttentionMetadata
from .checkpoint import load_state_dict, stored_precision
from .config import EngineConfig, ModelConfig
from .cuda_graph import DecodeGraphs, graph_batch_sizes
from .glm_model import GlmForCausalLM
from .memory import RESERVE_BYTES, available_bytes, check_fits, weight_bytes
from .quantization import resolve_method
from .scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def decode_kernel_wanted(backend: str, device: torch.device) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: decode attention uses the torch path")
        return False
    return True


def decode_graphs_wanted(config: EngineConfig, device: torch.device, use_decode_kernel: bool) -> bool:
    """Recording needs CUDA and the decode kernel (the torch path reads context lengths on the host)."""
    return config.cuda_graph_max_batch > 0 and device.type == "cuda" and use_decode_kernel


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int):
        self.model_config = model_config
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        self.use_decode_kernel = decode_kernel_wanted(config.attention_backend, self.device)
        stored = stored_precision(config.model_dir).method
        self.quantization = resolve_method(config.quantization, stored, self.device)
        if stored == "fp8" and config.quantization == "auto" and self.quantization == "none":
            log.warning("the FP8 checkpoint %s is served in %s: %s has no FP8 matmuls (quantization int8 keeps the "
                        "weights in 8 bits)", config.model_dir, self.dtype, self.device)

        # Built on the meta device so no memory is spent on random initial weights, then filled from the files.
        with torch.device("meta"):
            self.model = GlmForCausalLM(model_config, self.quantization)
        # Named before load_weights fuses q/k/v: the checkpoint's names (the memory check counts them too).
        self.quantized_weight_names = self.model.quantized_weight_names()
        self._check_memory(config, self.quantized_weight_names)
        self.model.load_weights(
            load_state_dict(config.model_dir, self.dtype, self.device, self.quantized_weight_names,
                            self.quantization),
            pack_for_cpu=self.device.type == "cpu")
        self.model.eval()

        use_graphs = decode_graphs_wanted(config, self.device, self.use_decode_kernel)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit(config) - use_graphs
        # [layers, k/v, blocks, block_size, kv_heads, head_dim]. Zeroed: masked slots must never hold NaN.
        # With CUDA graphs, one more block than the pool's: the scratch block that padding rows write to.
        kv_cache = torch.zeros(
            model_config.num_layers, 2, self.num_blocks + use_graphs, self.block_size,
            model_config.num_kv_heads, model_config.head_dim, dtype=self.dtype, device=self.device,
        )
        # Each layer's (keys, values): views of the one tensor.
        self.kv_caches = [(layer[0], layer[1]) for layer in kv_cache]
        self.decode_graphs = None
        if use_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, graph_batch_sizes(min(config.cuda_graph_max_batch, config.max_num_seqs)),
                max_blocks_per_seq=-(-max_model_len // self.block_size), scratch_block=self.num_blocks,
                block_size=self.block_size, device=self.device, use_decode_kernel=self.use_decode_kernel,
                record=self.device.type == "cuda")
        log.info("model on %s (%s, quantization %s), KV cache %d blocks of %d tokens (%.1f MiB), decode attention: %s",
                 self.device, self.dtype, self.quantization, self.num_blocks, self.block_size,
                 kv_cache.numel() * kv_cache.element_size() / 2**20,
                 "Triton kernel" if self.use_decode_kernel else "torch")

    def bytes_per_block(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize

    def _check_memory(self, config: EngineConfig, quantized: set[str]) -> None:
        """Before anything is loaded: refuse an engine that cannot fit beside what runs already (InsufficientMemory).
        On CUDA an engine takes gpu_memory_utilization of the device's memory (weights, KV cache, activations), so two
        versions fit on one GPU when their shares do; on the CPU, its weights and kv_cache_memory_mb."""
        what = f"the engine for {config.model_dir} on {self.device}"
        kv_bytes = config.num_kv_blocks * self.bytes_per_block() if config.num_kv_blocks else None
        if self.device.type == "cuda" and kv_bytes is None:
            total = torch.cuda.mem_get_info(self.device)[1]
            share = int(total * config.gpu_memory_utilization)
            check_fits(what, {f"gpu_memory_utilization {config.gpu_memory_utilization:g}": share},
                       available_bytes(self.device), reserve=0)
            return
        kv_bytes = kv_bytes if kv_bytes is not None else config.kv_cache_memory_mb * 2**20
        check_fits(what, {"weights": weight_bytes(config.model_dir, self.dtype, quantized), "KV cache": kv_bytes},
                   available_bytes(self.device))

    def _blocks_that_fit(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            # This engine's share of the device, less what it holds already (its weights), less room for
            # activations; never more than is free (another version's engine may run beside it).
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(int(total * config.gpu_memory_utilization) - torch.cuda.memory_reserved(self.device),
                         free) - RESERVE_BYTES
        else:
            budget = config.kv_cache_memory_mb * 2**20
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB budget); "
                             "raise kv_cache_memory_mb / gpu_memory_utilization or set num_kv_blocks")
        return num_blocks

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns float32 logits [sequences that sample, vocab], in batch order."""
        batch = step.scheduled
        input_ids, positions, slots, last_token_rows = [], [], [], []
        query_lens, context_lens, tables = [], [], []
        for item in batch:
            seq, start, count = item.seq, item.start, item.num_new_tokens
            input_ids += seq.token_ids[start:start + count]
            for pos in range(start, start + count):
                positions.append(pos)
                slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(count)
            context_lens.append(start + count)
            tables.append(seq.block_table)
            if item.samples:
                last_token_rows.append(len(input_ids) - 1)

        graphs = self.decode_graphs
        if graphs is not None and len(batch) == len(input_ids) <= graphs.max_batch:  # one new token per sequence
            logits = graphs.run(input_ids, positions, slots, tables, context_lens)
            # Row b is sequence b; a one-token prompt chunk that is not the prompt's last does not sample.
            return logits if len(last_token_rows) == len(batch) else logits[last_token_rows]

        max_blocks = max(len(t) for t in tables)
        padded_tables = [t + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            block_tables=tensor(padded_tables),
            context_lens=tensor(context_lens),
            query_lens=query_lens,
            host_context_lens=context_lens,
            use_decode_kernel=self.use_decode_kernel,
        )
        hidden = self.model(tensor(input_ids), tensor(positions), self.kv_caches, meta)
        return self.model.logits(hidden[tensor(last_token_rows)])
