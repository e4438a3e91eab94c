// Weight-only quantized linears for a few bf16 rows (tokenmill/quant/cpu_int4.py).
#pragma once

#include "common.h"

namespace tokenmill {

// y [M, N] = x [M, K] @ dequant(qweight)^T (+ bias), int4 in the "k64" layout with [N, G, 2] (scale, zero)
// pairs; false (nothing written) for a shape it does not serve or a CPU below AVX2.
bool int4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz,
                 const std::optional<at::Tensor>& bias, int64_t gs);
// y [M, N] = x [M, K] @ (qweight * scales + offsets)^T for M <= 8, per-channel int8; false as above.
bool int8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& offsets);
// The kernel both run at the level in force: "avx512_bf16", "avx2", or "none".
const char* int_kernel_name();

}  // namespace tokenmill
