"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf(tiny_llama):
    """Hugging Face transformers' float32 model of the tiny Llama checkpoint: the dense oracle."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
