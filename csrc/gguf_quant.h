// GGUF (llama.cpp) quantized weights, repacked losslessly at load into row groups that the integer kernels read
// 16 rows at a time (gguf_layout.h has the layout; tokenmill/quant/gguf.py the formats and the measurements).
#pragma once

#include "common.h"

namespace tokenmill {

// ggml's type ids (gguf.GGMLQuantizationType) of the block formats served here.
enum class GgmlType : int64_t { q4_0 = 2, q4_1 = 3, q5_0 = 6, q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14 };

bool gguf_type_served(int64_t type);   // one of GgmlType
int64_t gguf_block_weights(int64_t type);   // weights per block: 32, or 256 for the K formats
int64_t gguf_block_bytes(int64_t type);
int64_t gguf_record_bytes(int64_t type);    // bytes of one packed record: 16 rows of one block

// The integer kernel this CPU runs at the level in force: "avx512_vnni", "avx2" or "none" (below AVX2 the
// caller dequantizes; it says so loudly).
const char* gguf_kernel_name();

// blocks [N, K / block_weights * block_bytes] uint8 of `type`, N a multiple of 16 -> packed
// [N / 16, K / block_weights * record_bytes] uint8: every weight, scale and minimum kept as the file has them.
at::Tensor gguf_pack(const at::Tensor& blocks, int64_t type);

// y [M, sum of parts' rows] = x [M, K] @ dequant(parts)^T: part i, packed [N_i / 16, K / block_weights *
// record_bytes] uint8 of type types[i], fills columns [sum N_<i, + N_i). x float32 or bf16, contiguous; y the
// same dtype, rows of stride y.stride(0). Each row of x is quantized to int8 in groups of 32 (scale = max|x| /
// 127, as llama.cpp's Q8 activations) and dotted with the weights' integer codes; every row's result is the
// same bits whatever M is (batch-invariant). False (nothing written) without an integer kernel on this CPU.
bool gguf_linear(at::Tensor y, const at::Tensor& x, const std::vector<at::Tensor>& parts,
                 const std::vector<int64_t>& types);

// out [R, K] (float32 or bf16) = rows `rows` [R] (int64) of a packed tensor of `type`, dequantized in float32
// as ggml does (exact in float32), then rounded to out's dtype.
void gguf_dequantize_rows(at::Tensor out, const at::Tensor& packed, int64_t type, const at::Tensor& rows);

}  // namespace tokenmill
