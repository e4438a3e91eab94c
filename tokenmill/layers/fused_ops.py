"""Fused CPU kernels for the small ops between the matmuls of a decoder layer.

Why: at batch 1 a decode step of the default model spends ~6 ms in its 121 matmuls (about the
memory-bandwidth bound) and, before this module, ~4 ms more in ~1,500 tiny PyTorch op calls
(RMSNorm was 8 ops, RoPE 10 per tensor, SwiGLU 4, residual adds ...): per-call dispatch cost,
not arithmetic. Each function here replaces such a chain with one call:

    rms_norm(x, w)                  x / rms(x) * w
    add_rms_norm(x, r, w)           s = r + x; (rms_norm(s, w), s)
    rope_inplace(qk, cos_sin, pos)  rotate-half RoPE on every head of qk's rows, in place
    silu_and_mul(x)                 silu(x[:, :d]) * x[:, d:]
    linear_small(x, w, b)           x @ w.T + b for a few bf16 rows (decode, verification), AVX512-BF16;
                                    float32: one row, no bias, AVX-512 FMAs (MKL's sgemv reads ~16 GB/s here)

The last one exists because oneDNN's prepacked bf16 linear has a fixed cost of ~10 us per call
here (measured on a 64x64 weight, 1 or 2 threads) - 1.3 ms of a ~10 ms decode step over the
model's 121 linears - while a plain dot-product kernel over the row-major weight starts in ~2 us
and reads the weight at the same bandwidth.

Every function has a PyTorch reference (`*_ref`) that is the oracle in tests and the fallback
when the C++ build is unavailable (tokenmill/native.py), the tensor is not on CPU, not float32 /
bfloat16, or not laid out as the kernel expects. The kernels round exactly where the reference
does (float32 math, results cast to the tensor's dtype) so outputs agree to the last bit or
within one rounding of a differently ordered float32 sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill import native

_DTYPES = (torch.float32, torch.bfloat16)


def _ext():
    """torch.ops.tokenmill (csrc/fused_ops.cpp), or None without the C++ kernels."""
    return native.ops()


def is_available() -> bool:
    return native.available()


def _fast(*tensors: torch.Tensor):
    """The extension when every tensor is a contiguous CPU tensor of one supported dtype, else None."""
    t0 = tensors[0]
    if t0.device.type != "cpu" or t0.dtype not in _DTYPES or torch.is_grad_enabled() and t0.requires_grad:
        return None
    for t in tensors:
        if t.dtype != t0.dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None
    return _ext()


# ------------------------------------------------------------------------------- references
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = residual + x
    return rms_norm_ref(s, weight, eps), s


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D]; cos, sin broadcastable to [..., 1, D/2] float32 -> rotated x (new tensor)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---------------------------------------------------------------------------------- entry points
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _fast(x, weight)
    if ext is None:
        return rms_norm_ref(x, weight, eps)
    out = torch.empty_like(x)
    ext.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x); neither input is modified."""
    ext = _fast(x, residual, weight)
    if ext is None or x.shape != residual.shape:
        return add_rms_norm_ref(x, residual, weight, eps)
    out, s = torch.empty_like(x), torch.empty_like(x)
    ext.add_rms_norm(out, s, x, residual, weight, eps)
    return out, s


def rope_inplace(qk: torch.Tensor, num_heads: int, head_dim: int, cos_sin: torch.Tensor,
                 positions: torch.Tensor) -> bool:
    """Rotate the first num_heads * head_dim elements of every row of qk [N, row] in place (rows
    may be strided, elements within a row contiguous). Returns False, touching nothing, when
    the kernel cannot serve the call; the caller then uses `rope_ref`."""
    if (qk.dim() != 2 or qk.stride(1) != 1 or qk.device.type != "cpu" or qk.dtype not in _DTYPES
            or positions.dtype != torch.int64 or not positions.is_contiguous() or cos_sin.dtype != torch.float32
            or head_dim % 2 or num_heads * head_dim > qk.shape[1] or positions.numel() != qk.shape[0]):
        return False
    ext = _ext()
    if ext is None:
        return False
    ext.rope_inplace(qk, num_heads, head_dim, cos_sin, positions)
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a packed [gate | up] tensor: x [..., 2 * d] -> silu(gate) * up [..., d]."""
    ext = _fast(x)
    if ext is None:
        return silu_and_mul_ref(x)
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    ext.silu_mul(out, x)
    return out


SMALL_LINEAR_MAX_ROWS = 8
SMALL_LINEAR_MAX_OUTPUTS = 5000
"""Above one row the kernel's cost grows with rows x outputs (it turns compute-bound); measured here
at 5 rows it beats oneDNN on [960|576, 576] and [576, 1536] weights but loses 2x on [3072, 576], and at
2 rows it already loses on [3072, 576]. So: one row always, else rows x outputs <= 5000."""


VNNI_MIN_ROWS = 1
"""The fewest rows `linear_small` sends to the VNNI kernel when it has the packed copy. One row goes there
too, although the row-major GEMV is 2% faster per decoded token at batch 1 (5 interleaved rounds: 148.9
vs 145.7 tok/s): the VNNI kernel sums each row in the same order whatever the number of rows, so a
token's logits are bitwise the same decoded alone, in a batch of up to 8, or verified among drafts,
and greedy speculation reproduces plain decoding exactly (with the GEMV at one row it diverged from
plain decoding at near-ties in every configuration of benchmarks/spec_decode.py)."""


def pack_vnni(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 weight [N, K] -> its VNNI-packed copy [N/64, K/2, 64, 2] for `linear_small`'s few-row
    kernel, or None where that kernel cannot run (no C++ kernels or AVX512-BF16, N % 64 or K % 2)."""
    n, k = weight.shape
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or n % 64 or k % 2
            or not _has_avx512_bf16()):
        return None
    return weight.detach().reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _has_avx512_bf16() -> bool:
    return native.has_avx512_bf16()


def linear_small(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 vnni: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T + bias for bf16 rows on CPU, or None when no kernel here
    applies or would be slower (other dtype or shape, no AVX512-BF16); the caller then uses its own path.
    With `vnni` (pack_vnni(weight)) on an AMX CPU, any number of rows runs on the AMX kernel, whose
    result for a row does not depend on the other rows (the bf16 batch invariance). Elsewhere, with
    `vnni`, 1 to 8 rows run on the VNNI kernel, which stays memory-bound at
    every M up to 8 and gives each row the same bits whatever M is. Without it, the row-major GEMV
    takes one row, or up to 8 while M x N <= 5000.
    Float32 accumulation, one rounding to bf16 (like F.linear; sums run in another order)."""
    if (vnni is not None and x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous()
            and (bias is None or bias.dtype == torch.bfloat16) and native.has_amx()):
        # AMX: every row count, one reduction order (batch-invariant bf16, docs/native_kernels.md)
        y = x.new_empty(x.shape[0], weight.shape[0])
        if native.ops().linear_bf16_amx(y, x, vnni, bias):
            return y
    if (vnni is not None and x.dim() == 2 and VNNI_MIN_ROWS <= x.shape[0] <= SMALL_LINEAR_MAX_ROWS and x.dtype == torch.bfloat16
            and x.is_contiguous() and (bias is None or bias.dtype == torch.bfloat16)):
        y = x.new_empty(x.shape[0], weight.shape[0])
        if _ext().linear_bf16_vnni(y, x, vnni, bias):
            return y
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and bias is None and x.dim() == 2
            and x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous() and x.device.type == "cpu"):
        ext = _ext()
        if ext is None:
            return None
        y = x.new_empty(1, weight.shape[0])
        return y if ext.linear_f32_small(y, x, weight) else None
    if (x.dim() != 2 or x.shape[0] > SMALL_LINEAR_MAX_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or (x.shape[0] > 1 and x.shape[0] * weight.shape[0] > SMALL_LINEAR_MAX_OUTPUTS)
            or not x.is_contiguous() or not weight.is_contiguous() or x.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.bfloat16)):
        return None
    ext = _ext()
    if ext is None:
        return None
    y = x.new_empty(x.shape[0], weight.shape[0])
    return y if ext.linear_bf16_small(y, x, weight, bias) else None
