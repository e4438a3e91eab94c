// Paged attention on CPU (tokenmill/attention/cpu_kernels.py).
#pragma once

#include "common.h"

namespace tokenmill {

// The loops paged_decode chooses from (attention.cpp), by instruction set and shape.
enum class DecodeKernel : int { generic = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };
// The one paged_decode runs for q [B, Hq, D] against k_cache [nb, bs, Hkv, D] at the level in force;
// windowed: a key_start is given (sliding windows take the generic loop).
DecodeKernel decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, bool windowed);
const char* decode_kernel_name(DecodeKernel k);

// q [B, Hq, D] (one token per request) against each request's blocks; writes out [B, Hq, D].
// key_mask [B] int64 (token trees): bit j hides key seq_lens[b] - 1 - j from row b.
// key_start [B] int64 (sliding windows): row b attends keys [key_start[b], seq_lens[b]) only.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& key_start);
// Writes k, v [T, Hkv, D] at their slots [T] of the caches.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache);
// Writes k, v [B, Hkv, D] at their slots, then paged_decode.
void write_and_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& key_mask,
                      const std::optional<at::Tensor>& key_start);
// Causal prefill for bf16 caches on AVX512-BF16 CPUs; false (nothing written) when not served.
bool paged_prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_start,
                   const at::Tensor& q_len, double scale);

}  // namespace tokenmill
