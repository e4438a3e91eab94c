"""Weight-only int4 and int8 GEMVs for CPU decode: bf16 activations, int4 in our own layout; AVX512-BF16 and
AVX2 kernels.

(`int8_linear`, at the end: per-channel int8 rows converted exactly to float32 and FMA'd, up to 8
activation rows; it serves int8 checkpoints and the int8 LM head of int4 ones.)

Why: torch's `_weight_int4pack_mm_for_cpu` reads its packed weight at ~20 GB/s here, while the
bf16 GEMV of layers/fused_ops.py streams ~50 GB/s; an int4 step therefore gained only ~1.3x over
bf16 although it reads ~3.5x fewer bytes. The cost is not memory but turning nibbles into numbers
the FMA units take. This kernel does it in six instructions per 64 weights:

    w16 = zero-extend 32 bytes to 32 words     byte j of a 64-weight chunk = code[j] | code[j+32] << 4
    lo  = vpermw(table, w16)                  the index is the word's low 5 bits: low nibble + bit 4;
    hi  = vpermw(table, w16 >> 4)             table[i] = bf16((i & 15) - 8), exact
    acc = dpbf16(dpbf16(acc, lo, x[0:32]), hi, x[32:64])

and applies each group's scale once per group: y = sum_g s_g * sum_k (code_k - 8) x_k +
zero_g * sum_k x_k (tinygemm's affine form w = (code - 8) * s + zero). Products of bf16
values are exact in float32, sums are float32, so the result differs from the dequantize-then-
matmul reference only by the reference's rounding of w to bf16 and the order of the sums.

Layout "k64" (one row of bytes per output row, so a GEMV reads one sequential stream):
    qweight           [N, K/2] uint8   byte (n, 32c + j) = code[n, 64c + j] | code[n, 64c + 32 + j] << 4
    scales_and_zeros  [N, G, 2] bf16   (scale, zero) per row and group, row-major: with tinygemm's
                                       [G, N, 2] a row's G pairs lie N * 4 bytes apart, and the
                                       kernel ran ~25% slower on those scattered reads
Needs K % 64 == 0 and a group size that is a multiple of 64 (the default model's 64 is). It serves
any number of activation rows (blocks of up to 8 share each decoded weight chunk); the linear method
sends it calls of up to KernelPlan.int4_k64_max_rows rows (quant/kernels.py: a fixed rule, no timing) and
dequantizes then runs one dense matmul above that.
A software prefetch 4 KB ahead of the weight stream gained 10-30% out of cache here (two A/B runs).

On AVX2 (no bf16 dot products) both kernels widen the activations to float32 once per call (exact) and FMA
the codes converted 8 at a time (also exact): the same affine form, summed in float32, in another order than
the AVX512-BF16 kernel's (a CPU runs one of them; each is batch-invariant on its own).
"""

from __future__ import annotations

import torch

from tokenmill import native


def available() -> bool:
    """The kernels (csrc/quant_int.cpp) are built and this CPU has AVX2 at least."""
    return kernel_name() != "none"


def kernel_name() -> str:
    """The kernel at the ISA level in force: "avx512_bf16", "avx2", or "none"."""
    m = native.module()
    return "none" if m is None else m.int_kernel()


def layout_ok(in_features: int, group_size: int) -> bool:
    return in_features % 64 == 0 and group_size % 64 == 0 and in_features % group_size == 0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> qweight [N, K/2] uint8 in the k64 layout (module docstring)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 64, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: [N, K/2] uint8 -> [N, K] codes (uint8)."""
    n, half = packed.shape
    b = packed.reshape(n, half // 32, 1, 32)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, half * 2)


def linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """x [M, K] bf16 @ dequant(qweight)^T (+ bias) -> [M, N] bf16, or None when the kernel cannot serve it."""
    if (
        x.dtype != torch.bfloat16
        or scales_and_zeros.dtype != torch.bfloat16
        or x.dim() != 2
        or x.device.type != "cpu"
        or (bias is not None and bias.dtype != torch.bfloat16)
    ):
        return None
    ops = native.ops()
    return (
        None if ops is None else _run(ops.int4_linear, x, qweight.shape[0], qweight, scales_and_zeros, bias, group_size)
    )


def _run(kernel, x: torch.Tensor, n_out: int, *args) -> torch.Tensor | None:
    """y [M, n_out] = kernel(y, x, *args), or None when the kernel refuses the call."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], n_out)
    return y if kernel(y, x, *args) else None


INT8_MAX_ROWS = 8


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor | None:
    """Per-channel int8 weight-only linear for up to 8 bf16 rows: x @ (qweight * scales + offsets)^T,
    or None when the kernel cannot serve the call (the caller then uses torch's int8 kernel)."""
    if (
        x.dtype != torch.bfloat16
        or x.dim() != 2
        or x.shape[0] > INT8_MAX_ROWS
        or x.device.type != "cpu"
        or scales.dtype != torch.bfloat16
        or (offsets is not None and offsets.dtype != torch.bfloat16)
    ):
        return None
    ops = native.ops()
    return (
        None
        if ops is None
        else _run(
            ops.int8_linear,
            x,
            qweight.shape[0],
            qweight,
            scales.reshape(-1).contiguous(),
            None if offsets is None else offsets.reshape(-1).contiguous(),
        )
    )
