// The small ops between a decoder layer's matmuls, and the few-row linears (tokenmill/layers/fused_ops.py).
#pragma once

#include "common.h"

namespace tokenmill {

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
void add_rms_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                  double eps);
void rope_inplace(at::Tensor qk, int64_t n_heads, int64_t head_dim, const at::Tensor& cos_sin, const at::Tensor& pos);
void silu_mul(at::Tensor out, const at::Tensor& x);
// Gemma's norm: out = cast(x * rsqrt(mean(x^2) + eps) * (1 + w)), all in float32, one rounding (the checkpoint
// stores w - 1).
void rms_norm_unit_offset(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
// QK-norm: each of the first n_heads heads [head_dim] of every row of qk [N, row] (rows may be strided, a row's
// elements contiguous) normed in place with w [head_dim], as rms_norm (unit_offset: as rms_norm_unit_offset).
void head_rms_norm_inplace(at::Tensor qk, int64_t n_heads, int64_t head_dim, const at::Tensor& w, double eps,
                           bool unit_offset);
// GeGLU: out [N, d] = gelu_tanh(x[:, :d]) * x[:, d:], rounded as silu_mul (the gelu to T, then the product).
void gelu_tanh_mul(at::Tensor out, const at::Tensor& x);

// y = x @ w^T (+ bias) for a few rows; false (nothing written) when the kernel does not serve the call:
// the shape, or this CPU lacks the instructions (AVX512-BF16 for bf16, AVX-512 for float32).
bool linear_bf16_small(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
bool linear_bf16_vnni(at::Tensor y, const at::Tensor& x, const at::Tensor& wv, const std::optional<at::Tensor>& bias);
bool linear_f32_small(at::Tensor y, const at::Tensor& x, const at::Tensor& w);
// The AVX2 bf16 linear at any row count (fused_ops.cpp: one summation order per row whatever the rows, so
// batch-invariant); false without AVX2 or for K % 16 != 0.
bool linear_bf16_avx2(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// Any number of rows on AMX tiles, one reduction order whatever the row count (gemm_amx.cpp); false
// without AMX or for K % 32 != 0.
bool linear_bf16_amx(at::Tensor y, const at::Tensor& x, const at::Tensor& wv, const std::optional<at::Tensor>& bias);

}  // namespace tokenmill
