// Fused CPU kernels for the small ops between a decoder layer's matmuls, and the few-row linears
// (tokenmill/layers/fused_ops.py has the PyTorch references and the measurements behind each choice).
// Every op runs on any x86-64 CPU: the AVX-512 paths are chosen at run time (common.h), the scalar
// loops serve the rest. The kernels round exactly where the reference does (float32 math, results cast
// to the tensor's dtype), so outputs agree to the last bit or within one rounding of a differently
// ordered float32 sum.
#include "fused_ops.h"

namespace tokenmill {

// ---------------------------------------------------------------------------------- generic code

// out = w * cast(x * rsqrt(mean(x^2) + eps)), as RMSNorm's reference: float32 math, the normalized
// value cast to dtype before the (dtype) multiply by the weight.
// The row's 1 / rms. The float32 sum of squares goes in 16 lanes (lane l: elements l, l + 16, ...), then the
// lanes are added 8 + 4 + 2 + 1: one order at every call site and instruction-set level. (An `omp simd`
// reduction's order is the compiler's: it differed between the two norms' call sites.)
template <typename T>
static inline float inv_rms(const T* x, int64_t H, float eps) {
    float lane[16] = {};
    int64_t j = 0;
    for (; j + 16 <= H; j += 16)
        for (int l = 0; l < 16; ++l) { const float v = ld(x[j + l]); lane[l] += v * v; }
    for (int l = 0; j < H; ++j, ++l) { const float v = ld(x[j]); lane[l] += v * v; }
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    return 1.f / std::sqrt(lane[0] / static_cast<float>(H) + eps);
}

// Elements [j, H) of a normed row (vector code did the ones before j).
template <typename T>
static inline void norm_tail(const T* x, const T* w, T* out, int64_t j, int64_t H, float r) {
    for (; j < H; ++j) out[j] = st<T>(ld(w[j]) * ld(st<T>(ld(x[j]) * r)));
}

// Elements [j, H) of the residual sum r + x.
template <typename T>
static inline void add_tail(const T* r, const T* x, T* s, int64_t j, int64_t H) {
    for (; j < H; ++j) s[j] = st<T>(ld(r[j]) + ld(x[j]));
}

// Elements [j, half) of each half of one rotated head (x1 = x[j], x2 = x[j + half]).
template <typename T>
static inline void rope_tail(T* x, const float* c, const float* s, int64_t j, int64_t half) {
    for (; j < half; ++j) {
        const float x1 = ld(x[j]), x2 = ld(x[j + half]);
        const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
        x[j] = st<T>(a - b);
        x[j + half] = st<T>(e + f);
    }
}


// silu(g) * u for elements [j, d) of a row, rounded like the reference: silu in float32, rounded to T,
// times u, rounded to T.
template <typename T>
static inline void silu_mul_tail(const T* g, const T* u, T* o, int64_t j, int64_t d) {
    for (; j < d; ++j) {
        const float gv = ld(g[j]);
        const float sv = ld(st<T>(gv / (1.f + std::exp(-gv))));
        o[j] = st<T>(sv * ld(u[j]));
    }
}

// Elements [j, H) of a row normed with unit-offset weights (Gemma): x * r * (1 + w) in float32, one rounding.
template <typename T>
static inline void norm1p_tail(const T* x, const T* w, T* out, int64_t j, int64_t H, float r) {
    for (; j < H; ++j) out[j] = st<T>(ld(x[j]) * r * (1.f + ld(w[j])));
}

// gelu_tanh(g) = 0.5 g (1 + tanh(b (g + k g^3))) = g / (1 + exp(-2 b (g + k g^3))) (the sigmoid form has no
// cancellation where tanh nears -1); b = sqrt(2 / pi), k = 0.044715 as PyTorch's approximate="tanh".
constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;

// gelu_tanh(g) * u for elements [j, d) of a row, rounded as silu_mul_tail: the gelu rounded to T, the product too.
template <typename T>
static inline void gelu_tanh_mul_tail(const T* g, const T* u, T* o, int64_t j, int64_t d) {
    for (; j < d; ++j) {
        const float x = ld(g[j]);
        const float inner = kGeluBeta * (x + kGeluKappa * (x * x * x));
        const float gv = ld(st<T>(x / (1.f + std::exp(-2.f * inner))));
        o[j] = st<T>(gv * ld(u[j]));
    }
}

// ------------------------------------------------------------------------------------ AVX-512 code
#include "isa/avx512_begin.h"
#include "vec_avx512.h"

// gelu_tanh_mul_tail's first multiple of 16 elements, 16 lanes at a time (exp16 for std::exp).
template <typename T>
static int64_t gelu_tanh_mul_avx512(const T* g, const T* u, T* o, int64_t d) {
    const __m512 beta = _mm512_set1_ps(kGeluBeta), kappa = _mm512_set1_ps(kGeluKappa);
    const __m512 one = _mm512_set1_ps(1.f), m2 = _mm512_set1_ps(-2.f);
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        const __m512 x = load16(g + j);
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, x3)));
        const __m512 e = exp16(_mm512_mul_ps(m2, inner));
        const __m512 gv = round16(_mm512_div_ps(x, _mm512_add_ps(one, e)), (T*)nullptr);
        store16(o + j, round16(_mm512_mul_ps(gv, load16(u + j)), (T*)nullptr));
    }
    return j;
}

// norm1p_tail's arithmetic 16 lanes at a time: the same products and rounding, so the same bits.
template <typename T>
static int64_t norm1p_avx512(const T* x, const T* w, T* out, int64_t H, float r) {
    const __m512 rv = _mm512_set1_ps(r), one = _mm512_set1_ps(1.f);
    int64_t j = 0;
    for (; j + 16 <= H; j += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16(x + j), rv), _mm512_add_ps(one, load16(w + j)));
        store16(out + j, round16(y, (T*)nullptr));
    }
    return j;
}

// The first multiple of 16 elements of a silu_mul row, 16 lanes at a time (the scalar loop cost ~12% of
// a batched run's time); returns how far it got, the scalar tail does the rest.
template <typename T>
static int64_t silu_mul_avx512(const T* g, const T* u, T* o, int64_t d) {
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        const __m512 gv = load16(g + j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 sv = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), (T*)nullptr);
        store16(o + j, round16(_mm512_mul_ps(sv, load16(u + j)), (T*)nullptr));
    }
    return j;
}

// The vector parts of the norms, the residual sum and RoPE: the scalar tails' arithmetic 16 lanes at a time
// (the same float32 products, sums and roundings, so the same bits); each returns how far it got. Scalar
// and on one thread, a 34-row decode step's glue ops took 4.2 ms of ~28 (AMX host, bf16); now 2.1.
template <typename T>
static int64_t norm_avx512(const T* x, const T* w, T* out, int64_t H, float r) {
    const __m512 rv = _mm512_set1_ps(r);
    int64_t j = 0;
    for (; j + 16 <= H; j += 16) {
        const __m512 xn = round16(_mm512_mul_ps(load16(x + j), rv), (T*)nullptr);
        store16(out + j, round16(_mm512_mul_ps(load16(w + j), xn), (T*)nullptr));
    }
    return j;
}

template <typename T>
static int64_t add_avx512(const T* r, const T* x, T* s, int64_t H) {
    int64_t j = 0;
    for (; j + 16 <= H; j += 16) store16(s + j, round16(_mm512_add_ps(load16(r + j), load16(x + j)), (T*)nullptr));
    return j;
}

template <typename T>
static int64_t rope_avx512(T* x, const float* c, const float* s, int64_t half) {
    int64_t j = 0;
    for (; j + 16 <= half; j += 16) {
        const __m512 x1 = load16(x + j), x2 = load16(x + j + half);
        const __m512 cv = _mm512_loadu_ps(c + j), sv = _mm512_loadu_ps(s + j);
        const __m512 a = _mm512_mul_ps(x1, cv), b = _mm512_mul_ps(x2, sv);
        const __m512 e = _mm512_mul_ps(x2, cv), f = _mm512_mul_ps(x1, sv);
        store16(x + j, round16(_mm512_sub_ps(a, b), (T*)nullptr));
        store16(x + j + half, round16(_mm512_add_ps(e, f), (T*)nullptr));
    }
    return j;
}

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

static bool gemv_bf16_avx512(at::Tensor y, at::Tensor x, at::Tensor w, const std::optional<at::Tensor>& bias) {
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

static bool gemm_vnni_bf16_avx512(at::Tensor y, at::Tensor x, at::Tensor wv, const std::optional<at::Tensor>& bias) {
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

// The float32 twin of gemv_bf16 for one row: y [1, N] = x [1, K] @ w[N, K]^T, K % 16 == 0, row
// after row with 16-lane FMAs. (MKL's sgemv reads ~16 GB/s here; this reaches the bandwidth.)
static bool gemv_f32_avx512(at::Tensor y, at::Tensor x, at::Tensor w) {
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


#include "isa/avx512_end.h"

// --------------------------------------------------------------------------------------- AVX2 code
#include "isa/avx2_begin.h"
#include "vec_avx2.h"

// silu_mul_avx512's 8-lane twin (exp8 is exp16's algorithm).
template <typename T>
static int64_t silu_mul_avx2(const T* g, const T* u, T* o, int64_t d) {
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256 gv = load8(g + j);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 sv = round8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), (T*)nullptr);
        store8(o + j, round8(_mm256_mul_ps(sv, load8(u + j)), (T*)nullptr));
    }
    return j;
}

// The AVX2 linear, y [M, N] = x [M, K] @ w [N, K]^T (+ bias), float32 accumulation, one rounding at the
// end; bf16 or float32 weights, K % 16 == 0, any M. The bf16 input rows are converted once per call to
// float32 in bf16_even8/bf16_odd8's split order (per 16 elements: the 8 even ones, then the 8 odd ones),
// so a weight's 16 bf16 become two float vectors with one shift and one mask, no lane-crossing unpack.
// A tile of R rows x C outputs keeps R*C accumulators; each converted weight vector is FMA'd into R of them.
// Every (row, output) sum runs in one order whatever the tile, the row count or the thread split (one
// 8-lane accumulator over K in blocks of 16, even half then odd half, hsum8, + bias): a row's result
// does not depend on the other rows of the call (bf16 on AVX2 is batch-invariant in its linears).
static inline void wpair8(const float* w, __m256& lo, __m256& hi) {   // 16 float32 weights: as stored
    lo = _mm256_loadu_ps(w);
    hi = _mm256_loadu_ps(w + 8);
}
static inline void wpair8(const uint16_t* w, __m256& lo, __m256& hi) {   // 16 bf16 weights: split order
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    lo = bf16_even8(p);
    hi = bf16_odd8(p);
}

template <int R, int C, typename W>
static inline void linear_tile_avx2(const float* xf, const W* w, int64_t K, float* out) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m256 lo[C], hi[C];
        for (int c = 0; c < C; ++c) wpair8(w + c * K + k, lo[c], hi[c]);
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(xf + r * K + k);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, lo[c], acc[r][c]);
        }
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(xf + r * K + k + 8);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, hi[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) out[r * C + c] = hsum8(acc[r][c]);
}

// Rows [0, R) of xf against outputs [n0, n1) of w, results (+ bias) into y's rows: C outputs at a time,
// then one at a time for the last n1 - n0 mod C.
template <int R, int C, typename W, typename Y>
static void linear_rows_avx2(const float* xf, const W* w, const Y* bias, Y* y, int64_t K, int64_t N,
                             int64_t n0, int64_t n1) {
    float out[R * C];
    int64_t n = n0;
    for (; n + C <= n1; n += C) {
        linear_tile_avx2<R, C>(xf, w + n * K, K, out);
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c)
                y[r * N + n + c] = static_cast<Y>(out[r * C + c] + (bias ? static_cast<float>(bias[n + c]) : 0.f));
    }
    for (; n < n1; ++n) {
        linear_tile_avx2<R, 1>(xf, w + n * K, K, out);
        for (int r = 0; r < R; ++r) y[r * N + n] = static_cast<Y>(out[r] + (bias ? static_cast<float>(bias[n]) : 0.f));
    }
}

template <typename T>
static bool linear_avx2(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (K % 16 != 0 || M < 1 || !x.is_contiguous() || !w.is_contiguous() || !y.is_contiguous()) return false;
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    using W = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
    const W* wp = reinterpret_cast<const W*>(w.data_ptr<T>());
    std::vector<float> split;
    const float* xf;
    if constexpr (std::is_same_v<T, float>) {
        xf = x.data_ptr<float>();
    } else {
        split.resize(M * K);
        const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<T>());
        for (int64_t i = 0; i < M * K; i += 16) {
            __m256 lo, hi;
            wpair8(xp + i, lo, hi);
            _mm256_storeu_ps(split.data() + i, lo);
            _mm256_storeu_ps(split.data() + i + 8, hi);
        }
        xf = split.data();
    }
    // Outputs in blocks of NB, whose weights (~128 KiB) stay in L2 while every 4-row tile of x passes
    // over them. Threads split the outputs; calls under 2^17 multiply-adds stay on the calling thread.
    // The first row tile of a block reads its weights from memory: it takes one output at a time, so each
    // thread reads one sequential stream (from DRAM ~1.5x faster on the Zen 3 host than the 2-4 interleaved
    // streams of a multi-output tile: 15-17 vs 8-11 GB/s at one row, docs/native_kernels.md). Later row
    // tiles find the block in L2 and reuse each converted weight vector for C outputs. C does not change
    // any sum's order, so results are the same bits either way.
    const int64_t NB = std::max<int64_t>(8, (int64_t(1) << 17) / (K * static_cast<int64_t>(sizeof(W))) / 8 * 8);
    const int64_t grain = M * N * K < (int64_t(1) << 17) ? N : 8;
    at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
        for (int64_t n0 = b; n0 < e; n0 += NB) {
            const int64_t n1 = std::min(e, n0 + NB);
            int64_t m = 0;
            if (M >= 4) {
                linear_rows_avx2<4, 1>(xf, wp, bp, yp, K, N, n0, n1);
                m = 4;
            }
            for (; m + 4 <= M; m += 4)
                linear_rows_avx2<4, 2>(xf + m * K, wp, bp, yp + m * N, K, N, n0, n1);
            const bool cold = m == 0;
            switch (M - m) {
                case 3: cold ? linear_rows_avx2<3, 1>(xf, wp, bp, yp, K, N, n0, n1)
                             : linear_rows_avx2<3, 2>(xf + m * K, wp, bp, yp + m * N, K, N, n0, n1); break;
                case 2: cold ? linear_rows_avx2<2, 1>(xf, wp, bp, yp, K, N, n0, n1)
                             : linear_rows_avx2<2, 3>(xf + m * K, wp, bp, yp + m * N, K, N, n0, n1); break;
                case 1: cold ? linear_rows_avx2<1, 1>(xf, wp, bp, yp, K, N, n0, n1)
                             : linear_rows_avx2<1, 4>(xf + m * K, wp, bp, yp + m * N, K, N, n0, n1); break;
                default: break;
            }
        }
    });
    return true;
}

// gelu_tanh_mul_avx512's 8-lane twin.
template <typename T>
static int64_t gelu_tanh_mul_avx2(const T* g, const T* u, T* o, int64_t d) {
    const __m256 beta = _mm256_set1_ps(kGeluBeta), kappa = _mm256_set1_ps(kGeluKappa);
    const __m256 one = _mm256_set1_ps(1.f), m2 = _mm256_set1_ps(-2.f);
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256 x = load8(g + j);
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, x3)));
        const __m256 e = exp8(_mm256_mul_ps(m2, inner));
        const __m256 gv = round8(_mm256_div_ps(x, _mm256_add_ps(one, e)), (T*)nullptr);
        store8(o + j, round8(_mm256_mul_ps(gv, load8(u + j)), (T*)nullptr));
    }
    return j;
}

#include "isa/avx2_end.h"

// ------------------------------------------------------------------------------------ entry points

template <typename T>
static void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
    const int64_t H = x.size(-1), N = x.numel() / H;
    const T* xp = x.data_ptr<T>(); const T* wp = w.data_ptr<T>(); T* op = out.data_ptr<T>();
    const bool v16 = cpu_has_avx512();
    for_rows(N, H, [&](int64_t i) {
        const T* xr = xp + i * H; T* o = op + i * H;
        const float r = inv_rms(xr, H, (float)eps);
        norm_tail(xr, wp, o, v16 ? norm_avx512(xr, wp, o, H, r) : 0, H, r);
    });
}

template <typename T>
static void add_rms_norm_impl(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& r,
                              const at::Tensor& w, double eps) {
    const int64_t H = x.size(-1), N = x.numel() / H;
    const T* xp = x.data_ptr<T>(); const T* rp = r.data_ptr<T>(); const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>(); T* sp = sum.data_ptr<T>();
    const bool v16 = cpu_has_avx512();
    for_rows(N, H, [&](int64_t i) {
        T* s = sp + i * H; T* o = op + i * H;
        add_tail(rp + i * H, xp + i * H, s, v16 ? add_avx512(rp + i * H, xp + i * H, s, H) : 0, H);
        const float rr = inv_rms(s, H, (float)eps);
        norm_tail(s, wp, o, v16 ? norm_avx512(s, wp, o, H, rr) : 0, H, rr);
    });
}

// qk: [N, row_stride] rows whose first n_heads * D elements are heads to rotate (q heads then k heads of
// a packed qkv row). cos_sin: [max_pos, D] float32, cos in [:D/2], sin in [D/2:].
template <typename T>
static void rope_impl(at::Tensor& qk, int64_t n_heads, int64_t D, const at::Tensor& cos_sin, const at::Tensor& pos) {
    const int64_t N = qk.size(0), stride = qk.stride(0), half = D / 2;
    T* base = qk.data_ptr<T>();
    const float* cs = cos_sin.data_ptr<float>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const bool v16 = cpu_has_avx512();
    for_rows(N, n_heads * D, [&](int64_t i) {
        const float* c = cs + pp[i] * D; const float* s = c + half;
        for (int64_t h = 0; h < n_heads; ++h) {
            T* x = base + i * stride + h * D;
            rope_tail(x, c, s, v16 ? rope_avx512(x, c, s, half) : 0, half);
        }
    });
}

template <typename T>
static void silu_mul_impl(at::Tensor& out, const at::Tensor& x) {
    const int64_t d = out.size(-1), N = out.numel() / d;
    const T* xp = x.data_ptr<T>(); T* op = out.data_ptr<T>();
    const bool v16 = cpu_has_avx512(), v8 = cpu_has_avx2();
    for_rows(N, d, [&](int64_t i) {
        const T* g = xp + i * 2 * d; const T* u = g + d; T* o = op + i * d;
        silu_mul_tail(g, u, o, v16 ? silu_mul_avx512(g, u, o, d) : v8 ? silu_mul_avx2(g, u, o, d) : 0, d);
    });
}

template <typename T>
static void rms_norm_unit_offset_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
    const int64_t H = x.size(-1), N = x.numel() / H;
    const T* xp = x.data_ptr<T>(); const T* wp = w.data_ptr<T>(); T* op = out.data_ptr<T>();
    const bool v16 = cpu_has_avx512();
    for_rows(N, H, [&](int64_t i) {
        const T* xr = xp + i * H; T* o = op + i * H;
        const float r = inv_rms(xr, H, (float)eps);
        norm1p_tail(xr, wp, o, v16 ? norm1p_avx512(xr, wp, o, H, r) : 0, H, r);
    });
}

// qk: [N, row_stride] rows whose first n_heads * D elements are the heads to norm (rope_impl's layout).
template <typename T>
static void head_rms_norm_impl(at::Tensor& qk, int64_t n_heads, int64_t D, const at::Tensor& w, double eps,
                               bool unit_offset) {
    const int64_t N = qk.size(0), stride = qk.stride(0);
    T* base = qk.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    const bool v16 = cpu_has_avx512();
    for_rows(N, n_heads * D, [&](int64_t i) {
        for (int64_t h = 0; h < n_heads; ++h) {
            T* x = base + i * stride + h * D;
            const float r = inv_rms(x, D, (float)eps);
            if (unit_offset) norm1p_tail(x, wp, x, v16 ? norm1p_avx512(x, wp, x, D, r) : 0, D, r);
            else norm_tail(x, wp, x, v16 ? norm_avx512(x, wp, x, D, r) : 0, D, r);
        }
    });
}

template <typename T>
static void gelu_tanh_mul_impl(at::Tensor& out, const at::Tensor& x) {
    const int64_t d = out.size(-1), N = out.numel() / d;
    const T* xp = x.data_ptr<T>(); T* op = out.data_ptr<T>();
    const bool v16 = cpu_has_avx512(), v8 = cpu_has_avx2();
    for_rows(N, d, [&](int64_t i) {
        const T* g = xp + i * 2 * d; const T* u = g + d; T* o = op + i * d;
        gelu_tanh_mul_tail(g, u, o, v16 ? gelu_tanh_mul_avx512(g, u, o, d) : v8 ? gelu_tanh_mul_avx2(g, u, o, d) : 0, d);
    });
}

void rms_norm_unit_offset(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
    TOKENMILL_DISPATCH_FLOAT(x, "rms_norm_unit_offset", rms_norm_unit_offset_impl<T>(out, x, w, eps));
}
void head_rms_norm_inplace(at::Tensor qk, int64_t n_heads, int64_t head_dim, const at::Tensor& w, double eps,
                           bool unit_offset) {
    TORCH_CHECK(qk.dim() == 2 && qk.stride(1) == 1 && n_heads * head_dim <= qk.size(1) && w.numel() == head_dim &&
                    w.is_contiguous() && w.scalar_type() == qk.scalar_type(),
                "head_rms_norm_inplace: qk [N, >= n_heads * head_dim] with contiguous rows, w [head_dim] of its dtype");
    TOKENMILL_DISPATCH_FLOAT(qk, "head_rms_norm_inplace",
                             head_rms_norm_impl<T>(qk, n_heads, head_dim, w, eps, unit_offset));
}
void gelu_tanh_mul(at::Tensor out, const at::Tensor& x) {
    TOKENMILL_DISPATCH_FLOAT(x, "gelu_tanh_mul", gelu_tanh_mul_impl<T>(out, x));
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
    TOKENMILL_DISPATCH_FLOAT(x, "rms_norm", rms_norm_impl<T>(out, x, w, eps));
}
void add_rms_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                  double eps) {
    TOKENMILL_DISPATCH_FLOAT(x, "add_rms_norm", add_rms_norm_impl<T>(out, sum, x, r, w, eps));
}
void rope_inplace(at::Tensor qk, int64_t n_heads, int64_t head_dim, const at::Tensor& cos_sin, const at::Tensor& pos) {
    TOKENMILL_DISPATCH_FLOAT(qk, "rope_inplace", rope_impl<T>(qk, n_heads, head_dim, cos_sin, pos));
}
void silu_mul(at::Tensor out, const at::Tensor& x) {
    TOKENMILL_DISPATCH_FLOAT(x, "silu_mul", silu_mul_impl<T>(out, x));
}

bool linear_bf16_small(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    if (cpu_has_avx512_bf16()) return gemv_bf16_avx512(y, x, w, bias);
    return cpu_has_avx2() && x.size(0) <= 8 && linear_avx2<at::BFloat16>(y, x, w, bias);
}
bool linear_bf16_avx2(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    return cpu_has_avx2() && linear_avx2<at::BFloat16>(y, x, w, bias);
}
bool linear_bf16_vnni(at::Tensor y, const at::Tensor& x, const at::Tensor& wv, const std::optional<at::Tensor>& bias) {
    return cpu_has_avx512_bf16() && gemm_vnni_bf16_avx512(y, x, wv, bias);
}
bool linear_f32_small(at::Tensor y, const at::Tensor& x, const at::Tensor& w) {
    if (cpu_has_avx512()) return gemv_f32_avx512(y, x, w);
    return cpu_has_avx2() && x.size(0) == 1 && linear_avx2<float>(y, x, w, std::nullopt);
}

}  // namespace tokenmill
