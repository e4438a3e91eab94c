"""The runner in its own process (`--distributed-executor-backend mp`), driven over a pipe with the plain step data
of core/step_io.py.

    parent (engine core)                          child (runner)
    MultiprocExecutor.execute(StepInput) --pipe-->  ModelRunner.execute(StepInput)
                                         <--pipe--  StepOutput (tokens, drafts, speculation counters)

The child loads the model itself (worker/executor.load_target: the same checkpoint, dtype and LM head) and builds
its runner with build_runner, speculator included, so nothing but step data crosses. A child that dies, while
starting or during a step, is seen at once (the parent waits on its pipe and its process sentinel together): the
engine fails with the exit code and the start of what the child wrote to stderr.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from tokenmill.core.step_io import StepInput, StepOutput

if TYPE_CHECKING:
    from tokenmill.config import KVCacheSpec
    from tokenmill.worker.executor import RunnerOptions

MAIN_GUARD_HINT = (
    "Worker processes are spawned: they import the main module again. If your script creates the "
    "engine at import time (LLM(...) at the top level), put that code under "
    '`if __name__ == "__main__":`.'
)


class WorkerDiedError(RuntimeError):
    """A worker process (runner, tensor-parallel rank) exited or failed."""


class SpawnedWorker:
    """A spawned process whose stderr goes to a file, so a death can be reported with what it printed. On close
    (or death) that file is copied to this process's stderr, so nothing it logged is lost."""

    def __init__(self, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self.log = tempfile.NamedTemporaryFile(prefix=f"tokenmill-{name}-", suffix=".stderr", delete=False)
        self.proc = ctx.Process(target=target, args=args, daemon=True, name=name)
        # The child inherits fd 2 at spawn: point it at the file for the moment of the start only.
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(self.log.fileno(), 2)
            self.proc.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        self._echoed = False

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    def stderr_head(self, max_lines: int = 25) -> str:
        try:
            with open(self.log.name, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return ""
        return "\n".join(lines[:max_lines]) + ("\n..." if len(lines) > max_lines else "")

    def death_error(self, when: str) -> WorkerDiedError:
        """The error for this worker having exited `when` ("while starting", "during a step")."""
        self.proc.join(1)
        head = self.stderr_head()
        msg = f"{self.name} (pid {self.proc.pid}) exited with code {self.proc.exitcode} {when}"
        if head:
            msg += f"; the start of its stderr:\n{head}"
        if when == "while starting":
            msg += f"\n{MAIN_GUARD_HINT}"
        return WorkerDiedError(msg)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.is_alive():
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        if not self._echoed:
            self._echoed = True
            try:
                with open(self.log.name, errors="replace") as f:
                    text = f.read()
                if text:
                    sys.stderr.write(text)
                os.unlink(self.log.name)
            except OSError:
                pass
        self.log.close()


def watch(
    workers: list[SpawnedWorker], ready: Callable[[float], bool], when: str, timeout_s: float, poll_s: float = 0.25
) -> None:
    """Wait until ready(poll_s) is true, raising WorkerDiedError as soon as a worker exits first; TimeoutError
    after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not ready(poll_s):
        for w in workers:
            if not w.proc.is_alive():
                raise w.death_error(when)
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not get ready {when} within {timeout_s:.0f} s")


def _serve(opts: RunnerOptions, num_threads: int, conn) -> None:
    from tokenmill.worker.executor import build_runner, load_target

    try:
        torch.set_num_threads(num_threads)
        loaded = load_target(opts.model, load_tokenizer=False)
        runner = build_runner(loaded.model, loaded.config, opts)
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
    """The runner process raised; the message carries its traceback."""


class MultiprocExecutor:
    """The Executor of a ModelRunner that lives in a spawned child process."""

    def __init__(self, opts: RunnerOptions, num_threads: int = 1, timeout_s: float = 300.0) -> None:
        self.opts = opts
        self._conn, child = mp.get_context("spawn").Pipe()
        self.worker = SpawnedWorker("runner process", _serve, (opts, num_threads, child))
        child.close()
        self.steps = 0
        """Steps the child executed."""
        try:
            watch([self.worker], self._conn.poll, "while starting", timeout_s)
            kind, payload = self._conn.recv()
        except BaseException:
            self.shutdown()
            raise
        if kind != "ready":
            self.shutdown()
            raise RunnerProcessError(f"runner process failed to start:\n{payload}")

    @property
    def pid(self) -> int | None:
        return self.worker.proc.pid

    def execute(self, step: StepInput) -> StepOutput:
        try:
            self._conn.send(step)
        except (BrokenPipeError, OSError):
            raise self.worker.death_error("during a step") from None
        wait([self._conn, self.worker.sentinel])  # a reply, or the child's exit (its pipe then reads EOF)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise self.worker.death_error("during a step") from None
        if kind != "ok":
            raise RunnerProcessError(f"runner process failed a step:\n{payload}")
        self.steps += 1
        return payload

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.opts.kv_spec

    def local_kv_caches(self) -> list[torch.Tensor] | None:
        return None  # in the child

    def shutdown(self) -> None:
        if self.worker.proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.worker.close()
        self._conn.close()

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
