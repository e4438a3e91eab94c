"""tokenmill: an LLM inference engine with a paged KV cache and an OpenAI-compatible server."""
from __future__ import annotations

from tokenmill.sampling_params import SamplingParams

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
