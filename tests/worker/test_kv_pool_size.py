"""The KV pool's size rule (worker/executor.py, plan_kv_cache): the default caps a fraction of free memory at
DEFAULT_KV_TOKENS tokens; an explicit byte budget or fraction is taken as given. Exact block counts."""

from __future__ import annotations

import torch

from tokenmill.config import DEFAULT_KV_TOKENS, EngineConfig, ModelArchConfig
from tokenmill.worker.executor import plan_kv_cache

ARCH = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=30,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
)
# one block: 30 layers x K and V x 2 heads x 16 dims x 16 tokens x 4 bytes (float32)
BLOCK_BYTES = 30 * 2 * 2 * 16 * 16 * 4
GIB = 1 << 30


def blocks(available: int, **cache) -> int:
    cfg = EngineConfig.from_kwargs(model="smollm2-135m", dtype="float32", **cache)
    return plan_kv_cache(ARCH, cfg, 8192, available).num_blocks


def test_default_pool_is_capped_at_the_default_tokens():
    assert DEFAULT_KV_TOKENS == 16384
    assert blocks(24 * GIB) == 16384 // 16  # not 0.1 x 24 GiB (4,194 blocks here)
    assert blocks(10 * BLOCK_BYTES) == 1  # a small host: 0.1 of free memory is below the cap


def test_an_explicit_budget_or_fraction_is_taken_as_given():
    assert blocks(24 * GIB, kv_cache_memory_fraction=0.1) == int(24 * GIB * 0.1) // BLOCK_BYTES
    assert blocks(24 * GIB, kv_cache_memory_bytes=5000 * BLOCK_BYTES) == 5000


def test_the_dtype_sets_the_bytes_not_the_token_cap():
    cfg = EngineConfig.from_kwargs(model="smollm2-135m", dtype="bfloat16")
    spec = plan_kv_cache(ARCH, cfg, 8192, 24 * GIB)
    assert spec.num_blocks == 1024 and spec.dtype == torch.bfloat16
