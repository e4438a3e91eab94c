"""A ModelRunner in its own process, driven over a pipe with the plain step data of core/step_io.py.

    parent (scheduler)                         child (runner)
    RunnerProcess.execute(StepInput)  --pipe-->  ModelRunner.execute(StepInput)
                                      <--pipe--  dict[request id, SamplerResult]

The child loads the model itself (`load_model`, the same checkpoint and dtype), so nothing but step data
and results crosses: the runner's rows (core/step_io.py) are all it knows of the requests. This is the
seam prefill/decode workers and tensor-parallel ranks build on; tests/worker/test_runner_process.py
checks that its tokens equal an in-process runner's.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from tokenmill.core.step_io import SamplerResult, StepInput


@dataclass(frozen=True)
class RunnerSpec:
    """How the child builds its runner."""

    model: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_cache_dtype: str = "auto"
    seed: int = 0
    num_threads: int = 1


def _serve(spec: RunnerSpec, conn) -> None:
    from tokenmill.config import plan_kv_groups
    from tokenmill.models.loader import load_model
    from tokenmill.worker.model_runner import KVCacheSpec, ModelRunner

    try:
        torch.set_num_threads(spec.num_threads)
        dtype = getattr(torch, spec.dtype)
        loaded = load_model(spec.model, dtype=dtype, load_tokenizer=False)
        arch = loaded.config
        kv_dtype = torch.int8 if spec.kv_cache_dtype == "int8" else dtype
        groups = plan_kv_groups(arch.layer_windows())  # as EngineCore builds it (one group for Llama)
        kv = KVCacheSpec(spec.num_blocks, spec.block_size, len(groups[0].layers), arch.num_key_value_heads,
                         arch.head_dim, kv_dtype, tuple(groups) if len(groups) > 1 else ())
        runner = ModelRunner(loaded.model, arch, kv, torch.device("cpu"), seed=spec.seed)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        step = conn.recv()
        if step is None:
            return
        try:
            conn.send(("ok", runner.execute(step)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class RunnerProcessError(RuntimeError):
    pass


class RunnerProcess:
    """The `execute(StepInput)` of a ModelRunner that lives in a spawned child process."""

    def __init__(self, spec: RunnerSpec, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(spec, child), daemon=True)
        self._proc.start()
        child.close()
        self.steps = 0
        """Steps the child executed."""
        if not self._conn.poll(timeout_s):
            self.close()
            raise RunnerProcessError(f"runner process did not start within {timeout_s:.0f} s")
        kind, payload = self._conn.recv()
        if kind != "ready":
            self.close()
            raise RunnerProcessError(f"runner process failed to start:\n{payload}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def execute(self, step: StepInput) -> dict[str, SamplerResult]:
        self._conn.send(step)
        kind, payload = self._conn.recv()
        if kind != "ok":
            raise RunnerProcessError(f"runner process failed a step:\n{payload}")
        self.steps += 1
        return payload

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self) -> "RunnerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
