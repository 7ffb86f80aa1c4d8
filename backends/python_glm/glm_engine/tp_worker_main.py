"""A tensor-parallel worker: rank r > 0 of a tensor-parallel engine, started by rank 0 (glm_engine/tp_workers.py) as
`python -m glm_engine.tp_worker_main`, with the engine's configuration as JSON in --config.

It joins the process group, loads its part of the model and runs each step rank 0 sends, until rank 0 sends None.
Any error ends the process (rank 0 sees it); so does the end of rank 0's process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

import torch.distributed as dist

from .config import EngineConfig, ModelConfig
from .model_runner import ModelRunner
from .tensor_parallel import connect


def _exit_with_parent(parent: int) -> None:
    """End this worker when rank 0's process is gone (it may wait in a collective that will never complete)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A tensor-parallel rank of the GLM engine (started by rank 0).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig, as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{args.rank} %(name)s %(levelname)s: "
                                                   "%(message)s")
    threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    config = EngineConfig(**json.loads(args.config))
    store = dist.FileStore(args.store, args.world_size)
    store.set(f"up/{args.rank}", "1")
    shard = connect(args.rank, args.world_size, store, args.backend)
    model_config = ModelConfig.from_checkpoint(config.model_dir)
    runner = ModelRunner(model_config, config, config.model_len_limit(model_config), shard)
    while (inputs := shard.broadcast(None)) is not None:
        runner.run(inputs)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main()
