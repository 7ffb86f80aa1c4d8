"""CUDA graphs for decode-only steps: the forward pass of one token per sequence, recorded once per batch size and
replayed, so that a step costs one graph launch from the host instead of a few hundred kernel launches.

A graph reads fixed input buffers and writes a fixed logits tensor. A step of n sequences fills the first n rows of
the buffers and replays the graph of the smallest recorded size >= n. The rows past n are padding: they write their
key and value into a scratch block that the pool never hands out, attend to that one slot, and their logits are
dropped. Only decode-only steps are recorded: prefill lengths vary too much to pay.
"""

from __future__ import annotations

import logging
import time

import torch

from .attention import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself): padding wastes under 8 rows."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """record=False runs the same padded, fixed-buffer steps eagerly: that is how the tests check this class on
    the CPU, where nothing can be recorded. Recording needs the Triton decode kernel, which reads the context lengths
    on the device; the torch path reads them on the host."""

    def __init__(self, model, kv_caches, batch_sizes: list[int], max_blocks_per_seq: int, scratch_block: int,
                 block_size: int, device: torch.device, decode_kernel: str, record: bool):
        assert decode_kernel == "triton" or not record, "only the Triton kernel can be recorded"
        self.model, self.kv_caches = model, kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        rows = self.batch_sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((rows, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.decode_kernel = decode_kernel
        self._replays = {}
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if record else None
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its memory pool
                self._replays[size] = self._record(size, pool) if record else (lambda size=size: self._forward(size))
        if record:
            log.info("recorded CUDA graphs for decode batches of %s in %.1f s", self.batch_sizes,
                     time.perf_counter() - started)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """One decode step of len(input_ids) <= max_batch sequences. Returns float32 logits [sequences, vocab],
        a view of the graph's output: valid until the next step."""
        n = len(input_ids)
        size = next(s for s in self.batch_sizes if s >= n)
        width = max(len(table) for table in block_tables)
        device = self.input_ids.device

        def copy(target, values, dtype=torch.long):
            target.copy_(torch.tensor(values, dtype=dtype, device=device))

        copy(self.input_ids[:n], input_ids)
        copy(self.positions[:n], positions)
        copy(self.slot_mapping[:n], slots)
        copy(self.context_lens[:n], context_lens, torch.int32)
        copy(self.block_tables[:n, :width], [t + [self.scratch_block] * (width - len(t)) for t in block_tables],
             torch.int32)
        # Padding rows may hold a real sequence's slot from an earlier, larger step: point them at scratch again.
        self.slot_mapping[n:size].fill_(self.scratch_slot)
        self.context_lens[n:size].fill_(1)
        self.block_tables[n:size, 0].fill_(self.scratch_block)
        return self._replays[size]()[:n]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_lens=[1] * size,
            host_context_lens=[],  # read by mixed steps only; a recorded graph cannot know them
            decode_kernel=self.decode_kernel,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.logits(hidden)

    def _record(self, size: int, pool):
        self._forward(size)  # compiles the kernel and allocates lazily built state before recording
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(size)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay
