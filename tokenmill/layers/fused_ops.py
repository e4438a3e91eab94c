"""Fused CPU kernels for the small ops between the matmuls of a decoder layer.

Why: at batch 1 a decode step of the default model spends ~6 ms in its 121 matmuls (about the
memory-bandwidth bound) and, before this module, ~4 ms more in ~1,500 tiny PyTorch op calls
(RMSNorm was 8 ops, RoPE 10 per tensor, SwiGLU 4, residual adds ...): per-call dispatch cost,
not arithmetic. Each function here replaces such a chain with one call:

    rms_norm(x, w)                  x / rms(x) * w
    add_rms_norm(x, r, w)           s = r + x; (rms_norm(s, w), s)
    rms_norm_unit_offset(x, w)      x / rms(x) * (1 + w) in float32 (Gemma)
    head_rms_norm_inplace(qk, w)    either norm on each head of qk's rows, in place (QK-norm: Qwen3, Gemma 3)
    rope_inplace(qk, cos_sin, pos)  rotate-half RoPE on every head of qk's rows, in place
    silu_and_mul(x)                 silu(x[:, :d]) * x[:, d:]
    gelu_tanh_and_mul(x)            gelu_tanh(x[:, :d]) * x[:, d:] (GeGLU, Gemma)
    dense_linear(x, w, ...)         x @ w.T + b by one kernel rule for every caller (AMX, VNNI, GEMVs,
                                    oneDNN), shared with the C++ layer loop

The few-row GEMVs exist because oneDNN's prepacked bf16 linear has a fixed cost of ~10 us per call
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

import functools

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


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
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


def rms_norm_unit_offset_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (the checkpoint stores w - 1): all in float32, cast back once at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ---------------------------------------------------------------------------------- entry points
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _fast(x, weight)
    if ext is None:
        return rms_norm_ref(x, weight, eps)
    out = torch.empty_like(x)
    ext.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x); neither input is modified."""
    ext = _fast(x, residual, weight)
    if ext is None or x.shape != residual.shape:
        return add_rms_norm_ref(x, residual, weight, eps)
    out, s = torch.empty_like(x), torch.empty_like(x)
    ext.add_rms_norm(out, s, x, residual, weight, eps)
    return out, s


def rope_inplace(
    qk: torch.Tensor, num_heads: int, head_dim: int, cos_sin: torch.Tensor, positions: torch.Tensor
) -> bool:
    """Rotate the first num_heads * head_dim elements of every row of qk [N, row] in place (rows
    may be strided, elements within a row contiguous). Returns False, touching nothing, when
    the kernel cannot serve the call; the caller then uses `rope_ref`."""
    if (
        qk.dim() != 2
        or qk.stride(1) != 1
        or qk.device.type != "cpu"
        or qk.dtype not in _DTYPES
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
        or cos_sin.dtype != torch.float32
        or head_dim % 2
        or num_heads * head_dim > qk.shape[1]
        or positions.numel() != qk.shape[0]
    ):
        return False
    ext = _ext()
    if ext is None:
        return False
    ext.rope_inplace(qk, num_heads, head_dim, cos_sin, positions)
    return True


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] / rms * (1 + weight [H]) (Gemma's norm)."""
    ext = _fast(x, weight)
    if ext is None:
        return rms_norm_unit_offset_ref(x, weight, eps)
    out = torch.empty_like(x)
    ext.rms_norm_unit_offset(out, x, weight, eps)
    return out


def head_rms_norm_inplace(
    qk: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float, unit_offset: bool
) -> bool:
    """QK-norm: norm each of the first num_heads heads [head_dim] of every row of qk [N, row] in place with
    weight [head_dim], as `rms_norm` (unit_offset: as `rms_norm_unit_offset`). Rows may be strided (the k heads
    of a packed qkv row), elements within a row contiguous. Returns False, touching nothing, when the kernel
    cannot serve the call; the caller then uses the reference."""
    if (
        qk.dim() != 2
        or qk.stride(1) != 1
        or qk.device.type != "cpu"
        or qk.dtype not in _DTYPES
        or weight.dtype != qk.dtype
        or weight.numel() != head_dim
        or not weight.is_contiguous()
        or num_heads * head_dim > qk.shape[1]
        or torch.is_grad_enabled()
        and qk.requires_grad
    ):
        return False
    ext = _ext()
    if ext is None:
        return False
    ext.head_rms_norm_inplace(qk, num_heads, head_dim, weight, eps, unit_offset)
    return True


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU on a packed [gate | up] tensor: x [..., 2 * d] -> gelu_tanh(gate) * up [..., d]."""
    ext = _fast(x)
    if ext is None:
        return gelu_tanh_and_mul_ref(x)
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    ext.gelu_tanh_mul(out, x)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a packed [gate | up] tensor: x [..., 2 * d] -> silu(gate) * up [..., d]."""
    ext = _fast(x)
    if ext is None:
        return silu_and_mul_ref(x)
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    ext.silu_mul(out, x)
    return out


def pack_vnni(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 weight [N, K] -> its VNNI-packed copy [N/64, K/2, 64, 2], which the AMX kernel (any row count)
    and the VNNI kernel (1 to 8 rows) read, or None where neither can run (no C++ kernels or AVX512-BF16,
    N % 64 or K % 2)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or n % 64 or k % 2 or not native.has_avx512_bf16():
        return None
    return weight.detach().reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@functools.cache
def onednn_available() -> bool:
    """oneDNN can prepack and run bf16 linears on this CPU. Its bf16 path needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT: on an AVX2-only CPU `_reorder_linear_weight` raises, so ask oneDNN first."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 CPU weight [out, in] -> oneDNN's blocked layout (an opaque tensor), or None without oneDNN.
    Unpacked, oneDNN reorders the weight on every call: measured on the 2-core reference machine, one
    [3072, 576] layer at one row took 0.32 ms plain vs 0.06 ms prepacked. Results are bitwise F.linear's."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not onednn_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ the prepacked weight -> [..., out], the values of F.linear(x, weight, bias)."""
    return torch.ops.mkldnn._linear_pointwise.default(x.contiguous(), packed, bias, "none", [None], "")


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    vnni: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias on CPU by the dense linear's kernel rule (csrc/linear.h), which the
    C++ layer loop shares:

        bf16 with vnni (pack_vnni)       AMX tiles at any M: a row's sum runs in one order whatever M is
                                         (bf16 batch invariance, docs/native_kernels.md); else the VNNI
                                         kernel at 1 to 8 rows
        float32, one row, no bias        the AVX-512 GEMV (MKL's sgemv reads ~16 GB/s here)
        bf16, a few rows                 the row-major GEMV: one row, or up to 8 while M x N <= 5000
        bf16 with packed (pack_onednn)   oneDNN; otherwise F.linear

    Float32 accumulation, one rounding (like F.linear; sums in another order). Without the C++ kernels
    (or with autograd recording) oneDNN / F.linear serve every call."""
    ext = _ext()
    if (
        ext is not None
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in _DTYPES
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return ext.dense_linear(x, weight, vnni, packed, bias)
    if packed is not None and x.dtype == torch.bfloat16:
        return onednn_linear(x, packed, bias)
    return F.linear(x, weight, bias)
