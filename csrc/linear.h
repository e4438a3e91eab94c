// The dense linear's kernel rule, shared by the module path (layers/linear.py) and the C++ layer loop
// (decode_stack.cpp), so both give a row the same bits.
#pragma once

#include "common.h"

namespace tokenmill {

// Above one row the row-major GEMV turns compute-bound: it serves at most kSmallLinearMaxRows rows, and
// above one row only while rows x outputs <= kSmallLinearMaxOutputs (measured: at 5 rows it beats oneDNN on
// [960|576, 576] and [576, 1536] weights but loses 2x on [3072, 576]; at 2 rows it already loses on
// [3072, 576]). The VNNI kernel serves 1 to kSmallLinearMaxRows rows, memory-bound at every count. One row
// goes to it too, although the row-major GEMV is 2% faster at batch 1 (148.9 vs 145.7 tok/s, 5 interleaved
// rounds): the VNNI kernel sums a row in the same order whatever the row count, so a token's logits are
// the same decoded alone, in a small batch, or verified among drafts (with the GEMV at one row, greedy
// speculation diverged from plain decoding at near-ties).
constexpr int64_t kSmallLinearMaxRows = 8;
constexpr int64_t kSmallLinearMaxOutputs = 5000;

// y = x @ w^T + bias, x [M, K] contiguous, w [N, K]. The first kernel that serves the call:
//   bf16 with vnni (fused_ops.pack_vnni): AMX tiles at any M (one reduction order: batch-invariant),
//     else the VNNI kernel for M <= 8;
//   float32, one row, no bias: the AVX-512 GEMV;
//   bf16: the row-major GEMV for one row, or up to 8 rows while M x N <= 5000;
//   bf16 with packed (oneDNN's prepacked copy): oneDNN;
//   bf16 on an AVX2 CPU (where oneDNN has no bf16 path): the AVX2 kernel at any M, which sums a row in
//     the same order whatever M (batch-invariant, like AMX); otherwise at::linear.
// `y` [M, N] is written when the result is one of our kernels'; the returned tensor is the result.
at::Tensor dense_linear_into(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& vnni,
                             const std::optional<at::Tensor>& packed, const std::optional<at::Tensor>& bias);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& vnni,
                        const std::optional<at::Tensor>& packed, const std::optional<at::Tensor>& bias);

}  // namespace tokenmill
