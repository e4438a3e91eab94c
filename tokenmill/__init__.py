"""tokenmill: an LLM inference engine with a paged KV cache and an OpenAI-compatible server."""

from __future__ import annotations

import os

# NOTE: OpenMP threads that wait spin for ~300,000 rounds by default (libgomp); on a shared CPU that
# spinning takes the cores from the other process, and two such processes (a second server, a busy
# neighbour) slowed single-stream decode 14-44x here. A short spin keeps 91% of the quiet speed and
# 3-10x more under contention (docs/native_kernels.md, "Threads"). It takes effect only when tokenmill is
# imported before torch (the CLI and server are); GOMP_SPINCOUNT or OMP_WAIT_POLICY set by the user win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from tokenmill.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # NOTE: lazy so that `import tokenmill` stays cheap (the CLI and server import torch later).
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from tokenmill.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
