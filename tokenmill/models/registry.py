"""Architecture name -> model class, imported lazily."""

from __future__ import annotations

import importlib

# HF `architectures` entries and GGUF `general.architecture` values we run.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("tokenmill.models.gemma3", "Gemma3ForCausalLM"),
}
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
