"""The runner of a model split over N processes on this host (distributed/tensor_parallel.py shards it).

    rank 0 (engine)                              ranks 1 .. N-1 (spawned here)
    TPExecutor.execute(StepInput) -- broadcast -->  the same StepInput
    ModelRunner.execute on shard 0                  ModelRunner.execute on their shards
      ... all-reduces and the logits gather inside the forward keep them in step ...
    results of rank 0                                results dropped (identical)
"""
from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from torch import nn

from tokenmill.distributed.tensor_parallel import (SharedMemoryAllReduce, TPGroup, build_shard, free_port, make_group,
                                                  shard_model)


@dataclass(frozen=True)
class RankSpec:
    """What a rank > 0 needs to build its shard and runner (everything plain, for spawn)."""

    model: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    seed: int
    port: int
    rank: int
    size: int
    num_threads: int
    timeout_s: float


def _broadcast_step(group: TPGroup, step) -> object:
    """Rank 0 sends `step` (pickled), every other rank receives it; None ends the loop."""
    if group.rank == 0:
        data = pickle.dumps(step)
        size = torch.tensor([len(data)], dtype=torch.int64)
        group.pg.broadcast(size, 0).wait()
        if len(data):
            group.pg.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()
        return step
    size = torch.zeros(1, dtype=torch.int64)
    group.pg.broadcast(size, 0).wait()
    buf = torch.empty(int(size), dtype=torch.uint8)
    group.pg.broadcast(buf, 0).wait()
    return pickle.loads(buf.numpy().tobytes())


def _rank_main(spec: RankSpec, shm_data: torch.Tensor | None, shm_flags: torch.Tensor | None) -> None:
    from tokenmill.worker.model_runner import KVCacheSpec, ModelRunner
    try:
        torch.set_num_threads(spec.num_threads)
        shm = SharedMemoryAllReduce(shm_data, shm_flags, spec.rank) if shm_data is not None else None
        group = make_group(spec.port, spec.rank, spec.size, spec.timeout_s, shm=shm)
        dtype = getattr(torch, spec.dtype)
        loaded = build_shard(spec.model, dtype, group)
        arch = loaded.config
        kv_dtype = torch.int8 if spec.kv_cache_dtype == "int8" else dtype
        kv = KVCacheSpec(spec.num_blocks, spec.block_size, arch.num_hidden_layers,
                         arch.num_key_value_heads // spec.size, arch.head_dim, kv_dtype)
        runner = ModelRunner(loaded.model, arch, kv, torch.device("cpu"), seed=spec.seed, use_decode_loop=False)
    except Exception:  # noqa: BLE001 - rank 0 sees the group fail; the traceback goes to this rank's stderr
        traceback.print_exc()
        return
    while True:
        step = _broadcast_step(group, None)
        if step is None:
            return
        runner.execute(step)


class TPExecutor:
    """Rank 0's runner of a model split over `size` processes on this host (ranks 1.. spawned here). `model` is
    rank 0's loaded model, sharded here in place; `model_path` is what the other ranks load."""

    def __init__(self, model: nn.Module, model_path: str, dtype: torch.dtype, kv_spec, seed: int, size: int,
                 kv_cache_dtype: str = "auto", num_threads: int = 1, timeout_s: float = 300.0,
                 max_num_tokens: int | None = None) -> None:
        """max_num_tokens: the most tokens a step computes; sizes the shared-memory all-reduce (None: gloo only)."""
        from tokenmill.worker.model_runner import ModelRunner
        self.size = size
        port = free_port()
        ctx = mp.get_context("spawn")
        dname = str(dtype).removeprefix("torch.")
        shm_data = shm_flags = None
        if max_num_tokens is not None:
            shm_data, shm_flags = SharedMemoryAllReduce.create(size, max_num_tokens * model.config.hidden_size)
        self.procs = [ctx.Process(target=_rank_main, daemon=True, args=(RankSpec(
            model_path, dname, kv_spec.num_blocks, kv_spec.block_size, kv_cache_dtype, seed, port, r, size, num_threads,
            timeout_s), shm_data, shm_flags)) for r in range(1, size)]
        for p in self.procs:
            p.start()
        shm = SharedMemoryAllReduce(shm_data, shm_flags, 0) if shm_data is not None else None
        self.group = make_group(port, 0, size, timeout_s, is_master=True, shm=shm)
        shard_model(model, self.group)
        self.model = model
        self.runner = ModelRunner(model, model.config, kv_spec, torch.device("cpu"), seed=seed, use_decode_loop=False)
        self.kv_caches = self.runner.kv_caches

    def execute(self, step):
        _broadcast_step(self.group, step)
        return self.runner.execute(step)

    def close(self) -> None:
        try:
            _broadcast_step(self.group, None)
        except Exception:  # noqa: BLE001 - a rank already gone
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
