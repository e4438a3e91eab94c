"""int8 KV cache: symmetric int8 values with one fp16 scale per token and KV head, packed into
the same tensor so that every block operation (paging, prefix sharing, copy-on-write, preemption)
moves values and scales together.

    int8 cache: [2, num_blocks, block_size, num_kv_heads, head_dim + 2]
                                                          ^ head_dim int8 values, then the 2 bytes
                                                            of an fp16 scale
    scale = max|x| / 127 over one token's head_dim values;  x ~= q * scale

A token is quantized once, when written, so a partly filled block never needs requantizing.
Per element: 1 + 2 / head_dim bytes (head_dim 64: 1.03 B) against 2 B for bf16 and 4 B for fp32.
The attention backend dequantizes on read (`dequantize_kv`) to the query's dtype.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
"""Bytes per (token, KV head) for the packed fp16 scale."""


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def cache_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """Last dimension of the cache tensor for a model head_dim and cache dtype."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> packed int8 [..., D + 2]."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-6).to(torch.float16)  # [..., 1]
    q = torch.round(xf / scale.float()).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed int8 [..., D + 2] -> [..., D] in dtype."""
    scale = packed[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()  # [..., 1]
    return (packed[..., :-SCALE_BYTES].float() * scale).to(dtype)


def write_kv_int8(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache int8 [2, nb, bs, H, D + 2]; k, v [T, H, D]; slot_mapping [T]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, quantize_kv(k))
    flat[1].index_copy_(0, slot_mapping, quantize_kv(v))
