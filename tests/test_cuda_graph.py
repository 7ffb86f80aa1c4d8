"""Decode steps through cuda_graph.DecodeGraphs: fixed buffers, batches padded to a recorded size, padding rows in
a scratch block. Nothing can be recorded on the CPU, so these tests run the very same padded steps eagerly
(record=False), and check that what would be recorded never syncs with the host; scripts/gpu_check.py compares
recorded replays with eager steps on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from support.reference import assert_matches_reference, make_engine, prompts, record_logits, run_all

from glm_engine import model_runner
from glm_engine.cuda_graph import graph_batch_sizes


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """Let the runner build DecodeGraphs on the CPU, where it runs them without recording."""
    monkeypatch.setattr(model_runner, "decode_graphs_wanted", lambda config, device, kernel, shard: True)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_steps_match_transformers(tiny_model, graphs_on_the_cpu, backend):
    model_dir, model = tiny_model
    # Graphs up to 4 sequences. Three decode alone (padded to 4), four join them (a mixed step, then steps of
    # seven that run eagerly) and decode alone once the first three are done (a full graph batch).
    requests = {f"g{i}": p for i, p in enumerate(prompts((3, 9, 17, 1, 12, 6, 2), seed=21))}
    engine = make_engine(model_dir, cuda_graph_max_batch=4, max_num_seqs=8, attention_backend=backend)
    graphs = engine.runner.decode_graphs
    assert graphs.batch_sizes == [1, 2, 4] and graphs.scratch_block == engine.pool.num_blocks
    replayed = []
    run = graphs.run
    graphs.run = lambda *args: replayed.append(len(args[0])) or run(*args)
    records = record_logits(engine)
    outputs = run_all(engine, requests, join_after_steps=3)
    assert_matches_reference(model, requests, outputs, records)
    assert {3, 4} <= set(replayed), replayed  # a full and a padded batch both went through the graph buffers
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_padding_rows_write_only_the_scratch_block(tiny_model, graphs_on_the_cpu):
    model_dir, _ = tiny_model
    engine = make_engine(model_dir, cuda_graph_max_batch=8, num_kv_blocks=16)
    runner, graphs = engine.runner, engine.runner.decode_graphs
    block_size, caches = runner.block_size, [cache for layer in runner.kv_caches for cache in layer]

    def step(rows):
        """Decode one token for each (block, position) row, in a block of its own; returns the blocks written."""
        for cache in caches:
            cache.zero_()
        with torch.inference_mode():
            logits = graphs.run(
                input_ids=[5] * len(rows), positions=[pos for _, pos in rows],
                slots=[block * block_size + pos for block, pos in rows],
                block_tables=[[block] for block, _ in rows], context_lens=[pos + 1 for _, pos in rows])
        assert logits.shape == (len(rows), engine.model_config.vocab_size)
        written = torch.stack([(cache != 0).flatten(1).any(-1) for cache in caches]).any(0)  # [blocks]
        return set(written.nonzero().flatten().tolist())

    scratch = graphs.scratch_block
    assert step([(block, 3) for block in range(8)]) == set(range(8))  # a full batch: no padding
    # Three rows padded to four: the stale fourth row (block 3) must be sent to scratch, not rewritten.
    assert step([(9, 2), (10, 2), (11, 2)]) == {9, 10, 11, scratch}
    assert step([(12, 0)]) == {12}  # a batch of one is a recorded size: no padding row at all


# Operators that hand a device value to the host (or host data to the device). While a CUDA graph records, each
# one either fails the capture or is frozen into the graph, replaying a stale value on every later step.
HOST_SYNCS = {"aten.item", "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero",
              "aten.masked_select", "aten.lift_fresh"}


class HostSyncs(TorchDispatchMode):
    """Notes every operator from HOST_SYNCS that runs inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in HOST_SYNCS:
            self.seen.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend, recordable", [("triton", True), ("torch", False)])
def test_what_a_graph_records_never_syncs_with_the_host(tiny_model, graphs_on_the_cpu, backend, recordable):
    """The forward pass that DecodeGraphs records must keep every value on the device. The torch decode path reads
    the longest context on the host (so the runner never records it): that it is caught shows the check works."""
    model_dir, _ = tiny_model
    graphs = make_engine(model_dir, cuda_graph_max_batch=4, attention_backend=backend).runner.decode_graphs
    with torch.inference_mode():
        graphs._forward(4)  # lazily built state (the rotary table's move) is made before recording too
        with HostSyncs() as syncs:
            graphs._forward(4)
    assert (not syncs.seen) == recordable, syncs.seen
