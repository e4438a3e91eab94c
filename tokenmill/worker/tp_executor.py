"""The runner of a model split over N processes on this host (distributed/tensor_parallel.py shards it).

rank 0 (engine)                              ranks 1 .. N-1 (spawned here)
TPExecutor.execute(StepInput) -- broadcast -->  the same StepInput
ModelRunner.execute on shard 0                  ModelRunner.execute on their shards
  ... all-reduces and the logits gather inside the forward keep them in step ...
results of rank 0                                results dropped (identical)
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.config import KVCacheSpec
from tokenmill.core.step_io import PathMove, StepInput, StepOutput
from tokenmill.distributed.tensor_parallel import (
    SharedMemoryAllReduce,
    TPGroup,
    build_shard,
    free_port,
    make_group,
    shard_model,
)
from tokenmill.worker.executor import RunnerOptions, TPRank
from tokenmill.worker.process import SpawnedWorker, WorkerDiedError, watch

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM


@dataclass(frozen=True)
class RankSpec:
    """What a rank > 0 needs to build its shard and runner (everything plain, for spawn)."""

    opts: RunnerOptions
    port: int
    rank: int
    size: int
    num_threads: int
    timeout_s: float


@dataclass(frozen=True)
class RankStep:
    """What rank 0 broadcasts each step: the step, and the K/V moves its tree verification made in the step before
    (the other ranks do not verify; they replay the moves before this step's forward)."""

    step: StepInput
    path_moves: list[PathMove]


def _broadcast_step(group: TPGroup, step: RankStep | None) -> RankStep | None:
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


def _ready_key(rank: int) -> str:
    return f"tp-ready/{rank}"


def _rank_main(spec: RankSpec, shm_data: torch.Tensor | None, shm_flags: torch.Tensor | None) -> None:
    from tokenmill.worker.executor import build_runner

    try:
        torch.set_num_threads(spec.num_threads)
        shm = (
            SharedMemoryAllReduce(shm_data, shm_flags, spec.rank)
            if shm_data is not None and shm_flags is not None  # created together (TensorParallelExecutor)
            else None
        )
        group = make_group(spec.port, spec.rank, spec.size, spec.timeout_s, shm=shm)
        loaded = build_shard(spec.opts.model.model, spec.opts.model.torch_dtype, group)
        runner = build_runner(loaded.model, loaded.config, spec.opts, TPRank(spec.rank))
        group.store.set(_ready_key(spec.rank), "1")
    except Exception:  # noqa: BLE001 - rank 0 sees this rank exit; the traceback goes to this rank's stderr
        traceback.print_exc()
        sys.exit(1)
    while True:
        msg = _broadcast_step(group, None)
        if msg is None:
            return
        runner.move_paths(msg.path_moves)
        runner.execute(msg.step)


class TPExecutor:
    """Rank 0's runner of a model split over `size` processes on this host (ranks 1.. spawned here). `model` is
    rank 0's loaded model, sharded here in place; the other ranks load opts.model themselves. Rank 0 alone
    samples, verifies and proposes drafts; the others follow the steps it broadcasts (drafts included).

    A rank that exits while the group forms is reported within a second, with its exit code and stderr. One that
    dies between steps fails the next step before its broadcast; one that dies inside a step fails it in the
    shared-memory all-reduce's wait (check_peers) or in gloo's collective (its peer's socket closes), each as a
    WorkerDiedError."""

    def __init__(
        self,
        model: CausalLM,
        opts: RunnerOptions,
        num_threads: int = 1,
        timeout_s: float = 300.0,
        max_num_tokens: int | None = None,
    ) -> None:
        """max_num_tokens: the most tokens a step computes; sizes the shared-memory all-reduce (None: gloo only)."""
        from tokenmill.worker.executor import build_runner

        size = opts.model.tensor_parallel_size
        self.size = size
        self.opts = opts
        port = free_port()
        shm_data = shm_flags = None
        if max_num_tokens is not None:
            shm_data, shm_flags = SharedMemoryAllReduce.create(size, max_num_tokens * model.config.hidden_size)
        self.workers = [
            SpawnedWorker(
                f"tensor-parallel rank {r}",
                _rank_main,
                (RankSpec(opts, port, r, size, num_threads, timeout_s), shm_data, shm_flags),
            )
            for r in range(1, size)
        ]
        shm = (
            SharedMemoryAllReduce(shm_data, shm_flags, 0, self._check_workers)
            if shm_data is not None and shm_flags is not None  # created together above
            else None
        )
        self._closed = False
        try:
            self.group = self._form_group(port, size, timeout_s, shm)
        except BaseException:
            for w in self.workers:
                w.close(timeout_s=1.0)
            raise
        tables = None
        if opts.speculative is not None and opts.speculative.reads_target_tables:  # before the head is split
            from tokenmill.spec_decode.eagle_head import target_tables

            tables = target_tables(model)
        shard_model(model, self.group)
        self.model = model
        self.pending_moves: list[PathMove] = []
        """The K/V moves of the last step's verified trees, which ranks 1.. replay before the next step."""
        self.runner = build_runner(model, model.config, opts, TPRank(0, tables))
        keys = [_ready_key(r) for r in range(1, size)]  # every rank built its shard and runner

        def ready(poll_s: float) -> bool:
            if self.group.store.check(keys):
                return True
            time.sleep(poll_s)
            return False

        try:
            watch(self.workers, ready, "while starting", timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _form_group(self, port: int, size: int, timeout_s: float, shm: SharedMemoryAllReduce | None) -> TPGroup:
        """make_group on a helper thread while this one watches the ranks: one that exits first fails the start
        at once instead of after the store's timeout."""
        box: dict[str, object] = {}

        def form() -> None:
            try:
                box["group"] = make_group(port, 0, size, timeout_s, is_master=True, shm=shm)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e

        t = threading.Thread(target=form, name="tp-group", daemon=True)
        t.start()

        def done(poll_s: float) -> bool:
            t.join(poll_s)
            return not t.is_alive()

        watch(self.workers, done, "while starting", timeout_s + 5)
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["group"]  # type: ignore[return-value]

    def _check_workers(self) -> None:
        for w in self.workers:
            if not w.proc.is_alive():
                raise w.death_error("during a step")

    def execute(self, step: StepInput) -> StepOutput:
        self._check_workers()  # a rank that died since the last step: fail now, not in a collective's timeout
        try:
            _broadcast_step(self.group, RankStep(step, self.pending_moves))
            out = self.runner.execute(step)
            self.pending_moves = out.path_moves
            return out
        except RuntimeError as e:  # gloo: a peer's connection closed
            if isinstance(e, WorkerDiedError):
                raise
            for w in self.workers:
                w.proc.join(1.0)
            self._check_workers()
            raise

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.opts.kv_spec

    def local_kv_caches(self) -> list[torch.Tensor] | None:
        return None  # split across the ranks

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if all(w.proc.is_alive() for w in self.workers):
            try:
                _broadcast_step(self.group, None)
            except Exception:  # noqa: BLE001 - a rank already gone
                pass
        for w in self.workers:
            w.close()
