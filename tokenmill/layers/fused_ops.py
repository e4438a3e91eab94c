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
when the C++ build is unavailable (layers/cpp_ext.py), the tensor is not on CPU, not float32 /
bfloat16, or not laid out as the kernel expects. The kernels round exactly where the reference
does (float32 math, results cast to the tensor's dtype) so outputs agree to the last bit or
within one rounding of a differently ordered float32 sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers import cpp_ext

_SOURCE = cpp_ext.EXP16_SOURCE + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

static inline float ld(float x) { return x; }
static inline float ld(at::BFloat16 x) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f; std::memcpy(&f, &bits, sizeof(f)); return f;
}
template <typename T> static inline T st(float x) { return static_cast<T>(x); }   // RNE for bf16

// Rows are independent; run small calls (decode) on the calling thread: a parallel region
// costs more than it saves below ~64K elements.
template <typename F>
static void for_rows(int64_t n_rows, int64_t row_elems, const F& f) {
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(row_elems, 1));
    at::parallel_for(0, n_rows, grain, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) f(i); });
}

// out = w * cast(x * rsqrt(mean(x^2) + eps)), as RMSNorm's reference: float32 math, the
// normalized value cast to dtype before the (dtype) multiply by the weight.
template <typename T>
static inline void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int64_t j = 0; j < H; ++j) { const float v = ld(x[j]); ss += v * v; }
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t j = 0; j < H; ++j) out[j] = st<T>(ld(w[j]) * ld(st<T>(ld(x[j]) * r)));
}

template <typename T>
static void rms_norm_impl(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
    const int64_t H = x.size(-1), N = x.numel() / H;
    const T* xp = x.data_ptr<T>(); const T* wp = w.data_ptr<T>(); T* op = out.data_ptr<T>();
    for_rows(N, H, [&](int64_t i) { norm_row(xp + i * H, wp, op + i * H, H, (float)eps); });
}

template <typename T>
static void add_rms_norm_impl(torch::Tensor out, torch::Tensor sum, torch::Tensor x, torch::Tensor r,
                              torch::Tensor w, double eps) {
    const int64_t H = x.size(-1), N = x.numel() / H;
    const T* xp = x.data_ptr<T>(); const T* rp = r.data_ptr<T>(); const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>(); T* sp = sum.data_ptr<T>();
    for_rows(N, H, [&](int64_t i) {
        T* s = sp + i * H;
        for (int64_t j = 0; j < H; ++j) s[j] = st<T>(ld(rp[i * H + j]) + ld(xp[i * H + j]));
        norm_row(s, wp, op + i * H, H, (float)eps);
    });
}

// qk: [N, row_stride] rows whose first n_heads * D elements are heads to rotate (q heads then
// k heads of a packed qkv row). cos_sin: [max_pos, D] float32, cos in [:D/2], sin in [D/2:].
template <typename T>
static void rope_impl(torch::Tensor qk, int64_t n_heads, int64_t D, torch::Tensor cos_sin, torch::Tensor pos) {
    const int64_t N = qk.size(0), stride = qk.stride(0), half = D / 2;
    T* base = qk.data_ptr<T>();
    const float* cs = cos_sin.data_ptr<float>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    for_rows(N, n_heads * D, [&](int64_t i) {
        const float* c = cs + pp[i] * D; const float* s = c + half;
        for (int64_t h = 0; h < n_heads; ++h) {
            T* x = base + i * stride + h * D;
            for (int64_t j = 0; j < half; ++j) {
                const float x1 = ld(x[j]), x2 = ld(x[j + half]);
                const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
                x[j] = st<T>(a - b);
                x[j + half] = st<T>(e + f);
            }
        }
    });
}

// out [N, d] = silu(x[:, :d]) * x[:, d:], x [N, 2d]; silu rounded to dtype first, as the reference.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 silu_ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 silu_ld16(const at::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 silu_round(__m512 v, float*) { return v; }
static inline __m512 silu_round(__m512 v, at::BFloat16*) {   // to bf16 (round to nearest even) and back
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v),
        _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 16),
                                                                       _mm512_set1_epi32(1)))), 16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline void silu_st16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void silu_st16(at::BFloat16* p, __m512 v) {   // v is already bf16-exact
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif

// silu(g) * u per element, rounded like the reference: silu in float32, rounded to T, times u,
// rounded to T. 16 lanes at a time where AVX-512 is there (the scalar loop cost ~12% of a batched
// run's time), the scalar loop for the tail and elsewhere.
template <typename T>
static void silu_mul_impl(torch::Tensor out, torch::Tensor x) {
    const int64_t d = out.size(-1), N = out.numel() / d;
    const T* xp = x.data_ptr<T>(); T* op = out.data_ptr<T>();
    for_rows(N, d, [&](int64_t i) {
        const T* g = xp + i * 2 * d; const T* u = g + d; T* o = op + i * d;
        int64_t j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= d; j += 16) {
            const __m512 gv = silu_ld16(g + j);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 sv = silu_round(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), (T*)nullptr);
            silu_st16(o + j, silu_round(_mm512_mul_ps(sv, silu_ld16(u + j)), (T*)nullptr));
        }
#endif
        for (; j < d; ++j) {
            const float gv = ld(g[j]);
            const float sv = ld(st<T>(gv / (1.f + std::exp(-gv))));
            o[j] = st<T>(sv * ld(u[j]));
        }
    });
}


#if defined(__AVX512BF16__)
#include <immintrin.h>
// y [M, N] = x [M, K] @ w[N, K]^T (+ bias), bf16 in and out, float32 accumulation with
// vdpbf16ps, for a few rows (decode). Each weight row is read once for all M rows; output rows
// split across threads in blocks when the matrix is large enough to pay for a parallel region.
template <int M>
static int64_t gemv_rows(const uint16_t* xp, const uint16_t* wp, at::BFloat16* yp, const at::BFloat16* bp,
                         int64_t K, int64_t N, int64_t n, int64_t n1) {
    for (; n + 2 <= n1; n += 2) {
        __m512 a0[M], a1[M];
        for (int m = 0; m < M; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
        const uint16_t* w0 = wp + n * K;
        for (int64_t k = 0; k < K; k += 32) {
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k);
            const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w0 + K + k);
            for (int m = 0; m < M; ++m) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + m * K + k);
                a0[m] = _mm512_dpbf16_ps(a0[m], xv, v0);
                a1[m] = _mm512_dpbf16_ps(a1[m], xv, v1);
            }
        }
        const float b0 = bp ? static_cast<float>(bp[n]) : 0.f, b1 = bp ? static_cast<float>(bp[n + 1]) : 0.f;
        for (int m = 0; m < M; ++m) {
            yp[m * N + n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(a0[m]) + b0);
            yp[m * N + n + 1] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(a1[m]) + b1);
        }
    }
    return n;
}

static bool gemv_bf16(torch::Tensor y, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (K % 32 != 0 || M > 8) return false;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    const int64_t grain = N * K < (int64_t(1) << 17) ? N : 64;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        int64_t n = n0;
        if (M == 1) {  // one row after another: one sequential stream per thread (measured ~14% more
                       // bandwidth here than four rows side by side), four chains inside a row
            for (; n < n1; ++n) {
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
                const uint16_t* w0 = wp + n * K;
                int64_t k = 0;
                for (; k + 128 <= K; k += 128) {
                    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xp + k), (__m512bh)_mm512_loadu_si512(w0 + k));
                    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xp + k + 32), (__m512bh)_mm512_loadu_si512(w0 + k + 32));
                    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(xp + k + 64), (__m512bh)_mm512_loadu_si512(w0 + k + 64));
                    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(xp + k + 96), (__m512bh)_mm512_loadu_si512(w0 + k + 96));
                }
                for (; k < K; k += 32)
                    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xp + k), (__m512bh)_mm512_loadu_si512(w0 + k));
                const float b = bp ? static_cast<float>(bp[n]) : 0.f;
                yp[n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) + b);
            }
        }
        switch (M) {  // a few rows: two weight rows at a time against every input row, unrolled by M
            case 2: n = gemv_rows<2>(xp, wp, yp, bp, K, N, n, n1); break;
            case 3: n = gemv_rows<3>(xp, wp, yp, bp, K, N, n, n1); break;
            case 4: n = gemv_rows<4>(xp, wp, yp, bp, K, N, n, n1); break;
            case 5: n = gemv_rows<5>(xp, wp, yp, bp, K, N, n, n1); break;
            case 6: n = gemv_rows<6>(xp, wp, yp, bp, K, N, n, n1); break;
            case 7: n = gemv_rows<7>(xp, wp, yp, bp, K, N, n, n1); break;
            case 8: n = gemv_rows<8>(xp, wp, yp, bp, K, N, n, n1); break;
            default: break;
        }
        for (; n < n1; ++n) {
            __m512 acc[8];
            for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
            const uint16_t* wr = wp + n * K;
            for (int64_t k = 0; k < K; k += 32) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
                for (int64_t m = 0; m < M; ++m)
                    acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(xp + m * K + k), wv);
            }
            const float b = bp ? static_cast<float>(bp[n]) : 0.f;
            for (int64_t m = 0; m < M; ++m) yp[m * N + n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[m]) + b);
        }
    });
    return true;
}
#else
static bool gemv_bf16(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) { return false; }
#endif

#if defined(__AVX512BF16__)
// The few-row kernel over a VNNI-packed weight (docs/cpu_decode.md, "Few rows: the VNNI layout"):
// wv = pack of w [N, K] as [N/64, K/2, 64, 2], each block of 64 outputs stored k-pair after
// k-pair, an output's two weights side by side. One vdpbf16ps multiplies a broadcast pair of x
// with the pairs of 16 outputs and adds into 16 float lanes that each belong to one output, so
// nothing is summed across lanes at the end; each 64-byte weight load feeds all M rows.
template <int M>
static inline void vnni_tile(const uint32_t* xp, int64_t P, const uint16_t* wc, float* out) {
    // rows M (<= 6) x 64 outputs: 4M accumulators, 4 weight registers and a broadcast in 32 zmm.
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m) for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
        __m512bh wv[4];
        for (int b = 0; b < 4; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(wc + p * 128 + b * 32);
        for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m * P + p]);
            for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
        }
    }
    for (int m = 0; m < M; ++m) for (int b = 0; b < 4; ++b) _mm512_store_ps(out + m * 64 + b * 16, acc[m][b]);
}

template <int M>
static inline void vnni_chunk(const uint32_t* xp, int64_t P, const uint16_t* wc, float* out) {
    if constexpr (M <= 6) vnni_tile<M>(xp, P, wc, out);
    else {  // 7-8 rows: two passes over the chunk (the second from L2) rather than spilling registers
        vnni_tile<4>(xp, P, wc, out);
        vnni_tile<M - 4>(xp + 4 * P, P, wc, out + 4 * 64);
    }
}

static bool gemm_vnni_bf16(torch::Tensor y, torch::Tensor x, torch::Tensor wv, c10::optional<torch::Tensor> bias) {
    const int64_t M = x.size(0), K = x.size(1), NC = wv.size(0), N = NC * 64, P = K / 2;
    if (M < 1 || M > 8 || K % 2 || wv.size(1) != P) return false;
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(wv.data_ptr<at::BFloat16>());
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    const int64_t grain = N * K < (int64_t(1) << 17) ? NC : 1;
    at::parallel_for(0, NC, grain, [&](int64_t c0, int64_t c1) {
        alignas(64) float out[8 * 64];
        for (int64_t c = c0; c < c1; ++c) {
            const uint16_t* wc = wp + c * 64 * K;
            switch (M) {
                case 1: vnni_chunk<1>(xp, P, wc, out); break;
                case 2: vnni_chunk<2>(xp, P, wc, out); break;
                case 3: vnni_chunk<3>(xp, P, wc, out); break;
                case 4: vnni_chunk<4>(xp, P, wc, out); break;
                case 5: vnni_chunk<5>(xp, P, wc, out); break;
                case 6: vnni_chunk<6>(xp, P, wc, out); break;
                case 7: vnni_chunk<7>(xp, P, wc, out); break;
                default: vnni_chunk<8>(xp, P, wc, out); break;
            }
            for (int64_t m = 0; m < M; ++m)
                for (int b = 0; b < 4; ++b) {
                    __m512 v = _mm512_load_ps(out + m * 64 + b * 16);
                    if (bp) v = _mm512_add_ps(v, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(bp + c * 64 + b * 16))));
                    _mm256_storeu_si256((__m256i*)(yp + m * N + c * 64 + b * 16), (__m256i)_mm512_cvtneps_pbh(v));
                }
        }
    });
    return true;
}
#else
static bool gemm_vnni_bf16(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) { return false; }
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
// The float32 twin of gemv_bf16 for one row: y [1, N] = x [1, K] @ w[N, K]^T, K % 16 == 0, row
// after row with 16-lane FMAs. (MKL's sgemv reads ~16 GB/s here; this reaches the bandwidth.)
static bool gemv_f32(torch::Tensor y, torch::Tensor x, torch::Tensor w) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (K % 16 != 0 || M != 1) return false;
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t grain = N * K < (int64_t(1) << 16) ? N : 32;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        int64_t n = n0;
        for (; n < n1; ++n) {  // row after row (one sequential stream), four chains inside a row
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            const float* w0 = wp + n * K;
            int64_t k = 0;
            for (; k + 64 <= K; k += 64) {
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + k), _mm512_loadu_ps(w0 + k), a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + k + 16), _mm512_loadu_ps(w0 + k + 16), a1);
                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + k + 32), _mm512_loadu_ps(w0 + k + 32), a2);
                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + k + 48), _mm512_loadu_ps(w0 + k + 48), a3);
            }
            for (; k < K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + k), _mm512_loadu_ps(w0 + k), a0);
            yp[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        }
    });
    return true;
}
#else
static bool gemv_f32(torch::Tensor, torch::Tensor, torch::Tensor) { return false; }
#endif

bool linear_bf16_small(torch::Tensor y, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    return gemv_bf16(y, x, w, bias);
}

bool linear_bf16_vnni(torch::Tensor y, torch::Tensor x, torch::Tensor wv, c10::optional<torch::Tensor> bias) {
    return gemm_vnni_bf16(y, x, wv, bias);
}
bool vnni_supported() {
#if defined(__AVX512BF16__)
    return true;
#else
    return false;
#endif
}
bool linear_f32_small(torch::Tensor y, torch::Tensor x, torch::Tensor w) {
    return gemv_f32(y, x, w);
}

#define DISPATCH(t, ...) \
    if ((t).scalar_type() == at::kFloat) { using T = float; __VA_ARGS__; } \
    else if ((t).scalar_type() == at::kBFloat16) { using T = at::BFloat16; __VA_ARGS__; } \
    else TORCH_CHECK(false, "fused_ops: float32 or bfloat16 only");

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
    DISPATCH(x, rms_norm_impl<T>(out, x, w, eps))
}
void add_rms_norm(torch::Tensor out, torch::Tensor sum, torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps) {
    DISPATCH(x, add_rms_norm_impl<T>(out, sum, x, r, w, eps))
}
void rope_inplace(torch::Tensor qk, int64_t n_heads, int64_t head_dim, torch::Tensor cos_sin, torch::Tensor pos) {
    DISPATCH(qk, rope_impl<T>(qk, n_heads, head_dim, cos_sin, pos))
}
void silu_mul(torch::Tensor out, torch::Tensor x) {
    DISPATCH(x, silu_mul_impl<T>(out, x))
}
"""

_DECLS = """
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps);
void add_rms_norm(torch::Tensor out, torch::Tensor sum, torch::Tensor x, torch::Tensor r, torch::Tensor w, double eps);
void rope_inplace(torch::Tensor qk, int64_t n_heads, int64_t head_dim, torch::Tensor cos_sin, torch::Tensor pos);
void silu_mul(torch::Tensor out, torch::Tensor x);
bool linear_bf16_small(torch::Tensor y, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
bool linear_f32_small(torch::Tensor y, torch::Tensor x, torch::Tensor w);
bool linear_bf16_vnni(torch::Tensor y, torch::Tensor x, torch::Tensor wv, c10::optional<torch::Tensor> bias);
bool vnni_supported();
"""

_FUNCTIONS = ["rms_norm", "add_rms_norm", "rope_inplace", "silu_mul", "linear_bf16_small", "linear_f32_small", "linear_bf16_vnni", "vnni_supported"]
_DTYPES = (torch.float32, torch.bfloat16)


def _ext():
    return cpp_ext.load("tokenmill_fused_ops_v9", _DECLS, _SOURCE, _FUNCTIONS)


def is_available() -> bool:
    return _ext() is not None


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
    ext = _ext()
    return ext is not None and bool(ext.vnni_supported())


def linear_small(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 vnni: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T + bias for a few bf16 rows on CPU, or None when no kernel here
    applies or would be slower (other dtype or shape, no AVX512-BF16); the caller then uses its own path.
    With `vnni` (pack_vnni(weight)), 1 to 8 rows run on the VNNI kernel, which stays memory-bound at
    every M up to 8 and gives each row the same bits whatever M is. Without it, the row-major GEMV
    takes one row, or up to 8 while M x N <= 5000.
    Float32 accumulation, one rounding to bf16 (like F.linear; sums run in another order)."""
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
