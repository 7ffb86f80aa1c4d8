"""Tensor parallelism: which part of the model each rank holds, and the collectives that join the parts.

With `tensor_parallel_size` N, rank r of N holds (Megatron's split, as vLLM and TensorRT-LLM do it):
- query heads r*H/N .. (r+1)*H/N of every layer: the rows of q_proj (and its bias), the columns of o_proj;
- key/value heads likewise when there are at least N of them; with fewer, each is replicated on N/KV ranks, and a
  rank holds the one its query heads read (GLM-4-9B has 2 KV heads: at N = 4 each is held twice);
- rows r*I/N .. (r+1)*I/N of both halves of gate_up_proj (gate and up) and the same columns of down_proj;
- a slice of the vocabulary, ceil(V/N) rows of the embedding and of the LM head (zero rows pad the last slice);
- everything else (norms) whole.
o_proj and down_proj then give partial sums, added up by an all-reduce; the embedding's all-reduce adds the one
rank's row to the others' zeros; the LM head's logits are gathered on rank 0, which samples. Each rank's KV cache
holds its own KV heads, for the same block ids: the block tables rank 0 schedules are valid on every rank.

A Shard says all of that for one rank; with N = 1 (the default) it is the whole model and its collectives do nothing.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import CheckpointError, ModelConfig

# Checkpoint names (before q/k/v are fused) -> how the tensor is split: "rows"/"columns" by heads, KV heads, the
# MLP's intermediate channels, or the vocabulary.
_SPLITS = [
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), "rows", "heads"),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$"), "rows", "kv_heads"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "columns", "heads"),
    (re.compile(r"\.mlp\.gate_up_proj\.weight$"), "rows", "gate_up"),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "columns", "intermediate"),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "rows", "vocab"),
]

# Control messages wait as long as the engine is idle: no timeout in practice. A dead peer is seen at once anyway.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raise CheckpointError unless the checkpoint splits evenly over world_size ranks."""
    if world_size == 1:
        return
    problems = []
    if config.num_heads % world_size:
        problems.append(f"its {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= world_size and kv % world_size) or (kv < world_size and world_size % kv):
        problems.append(f"its {kv} key/value heads (which must be a multiple or a divisor of it)")
    if config.intermediate_size % world_size:
        problems.append(f"its MLP's {config.intermediate_size} channels")
    if problems:
        raise CheckpointError(f"tensor_parallel_size {world_size} does not divide {' nor '.join(problems)}")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world_size`. `device_group`: the forward pass's collectives (NCCL on CUDA, gloo on the CPU);
    `control_group`: gloo, for what rank 0 tells the others (each step's inputs, the KV pool's size)."""

    rank: int = 0
    world_size: int = 1
    device_group: object = None
    control_group: object = None

    # -- sizes ---------------------------------------------------------------------------------------------------
    def num_heads(self, config: ModelConfig) -> int:
        return config.num_heads // self.world_size

    def num_kv_heads(self, config: ModelConfig) -> int:
        return max(1, config.num_kv_heads // self.world_size)

    def first_kv_head(self, config: ModelConfig) -> int:
        # The KV head of this rank's first query head (with replication, several ranks share it).
        return self.rank * self.num_heads(config) // (config.num_heads // config.num_kv_heads)

    def intermediate_size(self, config: ModelConfig) -> int:
        return config.intermediate_size // self.world_size

    def vocab_rows(self, config: ModelConfig) -> int:
        return -(-config.vocab_size // self.world_size)

    def first_token(self, config: ModelConfig) -> int:
        return self.rank * self.vocab_rows(config)

    # -- splitting the checkpoint ----------------------------------------------------------------------------------
    def _ranges(self, name: str, config: ModelConfig) -> tuple[int, list[tuple[int, int]], int] | None:
        """How this rank's part of tensor `name` is cut: (dimension, [start, stop) ranges concatenated, size once
        padded), or None for a tensor held whole."""
        if self.world_size == 1:
            return None
        for pattern, axis, what in _SPLITS:
            if pattern.search(name):
                break
        else:
            return None
        dim = 0 if axis == "rows" else 1
        d = config.head_dim
        if what == "heads":
            n = self.num_heads(config) * d
            return dim, [(self.rank * n, (self.rank + 1) * n)], n
        if what == "kv_heads":
            first, n = self.first_kv_head(config) * d, self.num_kv_heads(config) * d
            return dim, [(first, first + n)], n
        i, n = config.intermediate_size, self.intermediate_size(config)
        if what == "gate_up":  # [gate; up], each cut alike
            start = self.rank * n
            return dim, [(start, start + n), (i + start, i + start + n)], 2 * n
        if what == "intermediate":
            return dim, [(self.rank * n, (self.rank + 1) * n)], n
        start, n = min(self.first_token(config), config.vocab_size), self.vocab_rows(config)  # vocab
        return dim, [(start, min(start + n, config.vocab_size))], n

    def split(self, name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a copy: torch.cat copies, so the whole can be freed)."""
        cut = self._ranges(name, config)
        if cut is None:
            return tensor
        dim, ranges, size = cut
        part = torch.cat([tensor.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)
        if part.shape[dim] < size:  # the last vocabulary slice: zero rows (their logits are dropped)
            padding = list(part.shape)
            padding[dim] = size - part.shape[dim]
            part = torch.cat([part, part.new_zeros(padding)], dim=dim)
        return part

    def split_shape(self, name: str, shape: torch.Size, config: ModelConfig) -> torch.Size:
        """The shape split() gives a tensor of this shape: for the memory check, read from file headers."""
        cut = self._ranges(name, config)
        if cut is None:
            return shape
        dim, _, size = cut
        return torch.Size([size if d == dim else s for d, s in enumerate(shape)])

    # -- collectives -------------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the same bits)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits for its vocabulary slice [rows, vocab_rows] -> the whole [rows, vocab_size] on rank 0,
        None elsewhere."""
        if self.world_size == 1:
            return logits
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None

    def broadcast(self, value: object) -> object:
        """Rank 0's `value` (any picklable object), on every rank, through the control group."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank is here (a rank that died makes it raise)."""
        if self.world_size > 1:
            dist.barrier(group=self.control_group)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' values (each rank's KV pool must have the same number of blocks)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t)


def connect(rank: int, world_size: int, store: dist.Store, backend: str) -> Shard:
    """Join the process group (every rank calls it) and make the control group beside it."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is running in this process already (one per process)")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    device_group = dist.group.WORLD
    return Shard(rank, world_size, device_group, control)
