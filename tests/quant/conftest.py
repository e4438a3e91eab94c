from __future__ import annotations

import pytest
import torch

from tokenmill.config import ModelArchConfig
from tokenmill.models.llama import LlamaForCausalLM


def make_tiny_config(**overrides) -> ModelArchConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelArchConfig(**base)


def make_tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random Llama with heavy-tailed per-channel activations (so AWQ/GPTQ have something to do)."""
    cfg = make_tiny_config(**overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data = 1 + 0.5 * torch.rand_like(p) * (torch.rand_like(p) < 0.1) * 8
        elif name.endswith("bias"):
            p.data.normal_(std=0.02)
        else:
            p.data.normal_(std=0.05)
    return model.eval()


@pytest.fixture
def tiny_model():
    return make_tiny_model()


def calib_ids(n: int = 8, t: int = 64, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (n, t), generator=torch.Generator().manual_seed(seed))
