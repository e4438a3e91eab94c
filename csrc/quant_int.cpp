// Weight-only int4 and int8 GEMVs for CPU decode: bf16 activations (tokenmill/quant/cpu_int4.py has the
// layouts and the measurements). Each has an AVX512-BF16 kernel and an AVX2 one (the activations widened to
// float32 once per call, the codes converted exactly and FMA'd); below AVX2 they return false, and the linear
// method takes torch's kernels or dequantizes.
#include "quant.h"

namespace tokenmill {

// How far ahead of the weight stream the int4 kernel prefetches (bytes): +10-30% out of cache here.
constexpr int64_t INT4_PREFETCH = 4096;

#include "isa/avx512_begin.h"


// Sums of x over each group (float32), the zero-point term's factor: xs [M, G].
static void int4_group_sums(const uint16_t* xp, int64_t M, int64_t K, int64_t gs, float* xs) {
    const int64_t G = K / gs;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
            __m512 a = _mm512_setzero_ps();
            const uint16_t* p = xp + m * K + g * gs;
            for (int64_t k = 0; k < gs; k += 16) {
                __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + k)));
                a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
            xs[m * G + g] = _mm512_reduce_add_ps(a);
        }
}

// R output rows x M activation rows per pass; every decoded 64-weight chunk is used M times.
template <int R, int M>
static void int4_block(const uint8_t* qp, const at::BFloat16* sz, const uint16_t* xp, const float* xs,
                       const at::BFloat16* bp, at::BFloat16* yp, int64_t n, int64_t K, int64_t N,
                       int64_t gs, int64_t m0, const __m512i table) {
    const int64_t G = K / gs, chunks_per_group = gs / 64, half = K / 2;
    __m512 tot[R][M];
    float zterm[R][M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) { tot[r][m] = _mm512_setzero_ps(); zterm[r][m] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
        __m512 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
            for (int r = 0; r < R; ++r) {
                const uint8_t* wq = qp + (n + r) * half + c * 32;
                if ((c & 1) == 0) _mm_prefetch((const char*)(wq + INT4_PREFETCH), _MM_HINT_T0);
                const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)wq));
                const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(w16, table);
                const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w16, 4), table);
                for (int m = 0; m < M; ++m) {
                    const uint16_t* xr = xp + (m0 + m) * K + c * 64;
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], lo, (__m512bh)_mm512_loadu_si512(xr));
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], hi, (__m512bh)_mm512_loadu_si512(xr + 32));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float s = static_cast<float>(sz[((n + r) * G + g) * 2]);
            const float z = static_cast<float>(sz[((n + r) * G + g) * 2 + 1]);
            const __m512 sv = _mm512_set1_ps(s);
            for (int m = 0; m < M; ++m) {
                tot[r][m] = _mm512_fmadd_ps(acc[r][m], sv, tot[r][m]);
                zterm[r][m] += z * xs[(m0 + m) * G + g];
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const float b = bp ? static_cast<float>(bp[n + r]) : 0.f;
        for (int m = 0; m < M; ++m)
            yp[(m0 + m) * N + n + r] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(tot[r][m]) + zterm[r][m] + b);
    }
}

template <int M>
static void int4_rows(const uint8_t* qp, const at::BFloat16* sz, const uint16_t* xp, const float* xs,
                      const at::BFloat16* bp, at::BFloat16* yp, int64_t n0, int64_t n1, int64_t K, int64_t N,
                      int64_t gs, int64_t m0, const __m512i table) {
    constexpr int R = M == 1 ? 4 : M == 2 ? 4 : M <= 4 ? 2 : 1;
    int64_t n = n0;
    for (; n + R <= n1; n += R) int4_block<R, M>(qp, sz, xp, xs, bp, yp, n, K, N, gs, m0, table);
    for (; n < n1; ++n) int4_block<1, M>(qp, sz, xp, xs, bp, yp, n, K, N, gs, m0, table);
}

static bool int4_linear_avx512(const at::Tensor& y, const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& sz, const std::optional<at::Tensor>& bias, int64_t gs) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (K % 64 || gs % 64 || K % gs || qweight.size(1) != K / 2 || sz.size(0) != N || sz.size(1) != K / gs) return false;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint8_t* qp = qweight.data_ptr<uint8_t>();
    const at::BFloat16* szp = sz.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    std::vector<float> xs(M * (K / gs));
    int4_group_sums(xp, M, K, gs, xs.data());
    alignas(64) uint16_t tbl[32];
    for (int i = 0; i < 32; ++i) {
        const float v = static_cast<float>((i & 15) - 8);
        uint32_t bits; std::memcpy(&bits, &v, 4); tbl[i] = static_cast<uint16_t>(bits >> 16);   // exact
    }
    const __m512i table = _mm512_load_si512(tbl);
    // Weight bytes are N * K / 2: stay on the calling thread below ~32 KB (a parallel region costs more).
    const int64_t grain = N * K < (int64_t(1) << 16) ? N : 32;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            switch (std::min<int64_t>(8, M - m0)) {
                case 1: int4_rows<1>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 2: int4_rows<2>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 3: int4_rows<3>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 4: int4_rows<4>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 5: int4_rows<5>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 6: int4_rows<6>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 7: int4_rows<7>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                default: int4_rows<8>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
            }
        }
    });
    return true;
}

// Weight-only int8 GEMV for a few rows (decode; the int8 LM head of int4 checkpoints): y [M, N] =
// x [M, K] @ (q [N, K] * scale[N] + offset[N])^T, x bf16, float32 math with exact int8 -> float
// conversion (no activation quantization). ~3 ops per 16 weights keeps it at the memory bound;
// torch's _weight_int8pack_mm read ~32 GB/s here against ~70 for a plain stream.
static bool int8_linear_avx512(const at::Tensor& y, const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& scales, const std::optional<at::Tensor>& offsets) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (K % 64 || M > 8 || qweight.size(1) != K || scales.numel() != N) return false;
    const uint16_t* xp16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const int8_t* qp = qweight.data_ptr<int8_t>();
    const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
    const at::BFloat16* op = offsets.has_value() ? offsets->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    std::vector<float> xf(M * K), xsum(M, 0.f);
    for (int64_t i = 0; i < M * K; ++i) {
        uint32_t b = static_cast<uint32_t>(xp16[i]) << 16; std::memcpy(&xf[i], &b, 4);
        xsum[i / K] += xf[i];
    }
    const float* xp = xf.data();
    const int64_t grain = N * K < (int64_t(1) << 17) ? N : 64;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        if (M == 1) {  // one row: four independent FMA chains (two were latency-bound)
            for (int64_t n = n0; n < n1; ++n) {
                const int8_t* w = qp + n * K;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t k = 0; k < K; k += 64) {
                    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k)))),
                                         _mm512_loadu_ps(xp + k), a0);
                    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 16)))),
                                         _mm512_loadu_ps(xp + k + 16), a1);
                    a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 32)))),
                                         _mm512_loadu_ps(xp + k + 32), a2);
                    a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 48)))),
                                         _mm512_loadu_ps(xp + k + 48), a3);
                }
                const float sc = static_cast<float>(sp[n]), of = op ? static_cast<float>(op[n]) : 0.f;
                yp[n] = static_cast<at::BFloat16>(
                    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) * sc + of * xsum[0]);
            }
            return;
        }
        for (int64_t n = n0; n < n1; ++n) {
            const int8_t* w = qp + n * K;
            __m512 acc[8][2];
            for (int64_t m = 0; m < M; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
            for (int64_t k = 0; k < K; k += 32) {
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k))));
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 16))));
                for (int64_t m = 0; m < M; ++m) {
                    acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + m * K + k), acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + m * K + k + 16), acc[m][1]);
                }
            }
            const float sc = static_cast<float>(sp[n]), of = op ? static_cast<float>(op[n]) : 0.f;
            for (int64_t m = 0; m < M; ++m)
                yp[m * N + n] = static_cast<at::BFloat16>(
                    _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) * sc + of * xsum[m]);
        }
    });
    return true;
}
#include "isa/avx512_end.h"

// ------------------------------------------------------------------------------- AVX2

#include "isa/avx2_begin.h"
#include "vec_avx2.h"

// x bf16 [M, K] -> float32 (exact), and each row's sums over groups of gs (gs = K: one sum per row).
static void widen_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t gs, float* xf, float* xs) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < K / gs; ++g) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {
                const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xp + m * K + k)));
                const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                _mm256_storeu_ps(xf + m * K + k, f);
                a = _mm256_add_ps(a, f);
            }
            xs[m * (K / gs) + g] = hsum8(a);
        }
}

// 8 signed bytes at byte 8i of a 32-byte vector -> float32 (exact).
static inline __m256 bytes_to_f32(__m256i v, int i) {
    const __m128i half = i < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i % 2 ? _mm_srli_si128(half, 8) : half));
}

// As int4_block: R output rows x M activation rows per pass, each 64-weight chunk decoded once (codes - 8 as
// bytes, then 8 at a time to float32) and FMA'd with M rows of float32 activations.
template <int R, int M>
static void int4_block_avx2(const uint8_t* qp, const at::BFloat16* sz, const float* xf, const float* xs,
                            const at::BFloat16* bp, at::BFloat16* yp, int64_t n, int64_t K, int64_t N, int64_t gs,
                            int64_t m0) {
    const int64_t G = K / gs, chunks_per_group = gs / 64, half = K / 2;
    const __m256i low4 = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    __m256 tot[R][M];
    float zterm[R][M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) { tot[r][m] = _mm256_setzero_ps(); zterm[r][m] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
        __m256 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
        for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c)
            for (int r = 0; r < R; ++r) {
                const uint8_t* wq = qp + (n + r) * half + c * 32;
                if ((c & 1) == 0) _mm_prefetch((const char*)(wq + INT4_PREFETCH), _MM_HINT_T0);
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
                const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(v, low4), eight);   // weights 64c + 0..31
                const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), eight);   // + 32..63
                for (int i = 0; i < 8; ++i) {
                    const __m256 w = bytes_to_f32(i < 4 ? lo : hi, i % 4);
                    for (int m = 0; m < M; ++m)
                        acc[r][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xf + (m0 + m) * K + c * 64 + 8 * i), acc[r][m]);
                }
            }
        for (int r = 0; r < R; ++r) {
            const __m256 sv = _mm256_set1_ps(static_cast<float>(sz[((n + r) * G + g) * 2]));
            const float z = static_cast<float>(sz[((n + r) * G + g) * 2 + 1]);
            for (int m = 0; m < M; ++m) {
                tot[r][m] = _mm256_fmadd_ps(acc[r][m], sv, tot[r][m]);
                zterm[r][m] += z * xs[(m0 + m) * G + g];
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const float b = bp ? static_cast<float>(bp[n + r]) : 0.f;
        for (int m = 0; m < M; ++m)
            yp[(m0 + m) * N + n + r] = static_cast<at::BFloat16>(hsum8(tot[r][m]) + zterm[r][m] + b);
    }
}

template <int M>
static void int4_rows_avx2(const uint8_t* qp, const at::BFloat16* sz, const float* xf, const float* xs,
                           const at::BFloat16* bp, at::BFloat16* yp, int64_t n0, int64_t n1, int64_t K, int64_t N,
                           int64_t gs, int64_t m0) {
    constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;   // 16 ymm registers: R x M accumulators and as many totals
    int64_t n = n0;
    for (; n + R <= n1; n += R) int4_block_avx2<R, M>(qp, sz, xf, xs, bp, yp, n, K, N, gs, m0);
    for (; n < n1; ++n) int4_block_avx2<1, M>(qp, sz, xf, xs, bp, yp, n, K, N, gs, m0);
}

static bool int4_linear_avx2(const at::Tensor& y, const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& sz, const std::optional<at::Tensor>& bias, int64_t gs) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (K % 64 || gs % 64 || K % gs || qweight.size(1) != K / 2 || sz.size(0) != N || sz.size(1) != K / gs) return false;
    std::vector<float> xf(M * K), xs(M * (K / gs));
    widen_rows(x.data_ptr<at::BFloat16>(), M, K, gs, xf.data(), xs.data());
    const uint8_t* qp = qweight.data_ptr<uint8_t>();
    const at::BFloat16* szp = sz.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    const int64_t grain = N * K < (int64_t(1) << 16) ? N : 32;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            switch (std::min<int64_t>(4, M - m0)) {
                case 1: int4_rows_avx2<1>(qp, szp, xf.data(), xs.data(), bp, yp, n0, n1, K, N, gs, m0); break;
                case 2: int4_rows_avx2<2>(qp, szp, xf.data(), xs.data(), bp, yp, n0, n1, K, N, gs, m0); break;
                case 3: int4_rows_avx2<3>(qp, szp, xf.data(), xs.data(), bp, yp, n0, n1, K, N, gs, m0); break;
                default: int4_rows_avx2<4>(qp, szp, xf.data(), xs.data(), bp, yp, n0, n1, K, N, gs, m0); break;
            }
        }
    });
    return true;
}

// As int8_linear_avx512: the int8 rows converted exactly to float32 and FMA'd, up to 8 activation rows.
static bool int8_linear_avx2(const at::Tensor& y, const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const std::optional<at::Tensor>& offsets) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (K % 64 || M > 8 || qweight.size(1) != K || scales.numel() != N) return false;
    std::vector<float> xf(M * K), xsum(M);
    widen_rows(x.data_ptr<at::BFloat16>(), M, K, K, xf.data(), xsum.data());
    const int8_t* qp = qweight.data_ptr<int8_t>();
    const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
    const at::BFloat16* op = offsets.has_value() ? offsets->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    const float* xp = xf.data();
    const int64_t grain = N * K < (int64_t(1) << 17) ? N : 64;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
            const int8_t* w = qp + n * K;
            __m256 acc[8][2];
            for (int64_t m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
                for (int i = 0; i < 4; ++i) {
                    const __m256 wf = bytes_to_f32(v, i);
                    for (int64_t m = 0; m < M; ++m)
                        acc[m][i % 2] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xp + m * K + k + 8 * i), acc[m][i % 2]);
                }
            }
            const float sc = static_cast<float>(sp[n]), of = op ? static_cast<float>(op[n]) : 0.f;
            for (int64_t m = 0; m < M; ++m)
                yp[m * N + n] = static_cast<at::BFloat16>(hsum8(_mm256_add_ps(acc[m][0], acc[m][1])) * sc + of * xsum[m]);
        }
    });
    return true;
}
#include "isa/avx2_end.h"

const char* int_kernel_name() {
    if (cpu_has_avx512_bf16()) return "avx512_bf16";
    if (cpu_has_avx2()) return "avx2";
    return "none";
}

bool int4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& sz,
                 const std::optional<at::Tensor>& bias, int64_t gs) {
    if (cpu_has_avx512_bf16()) return int4_linear_avx512(y, x, qweight, sz, bias, gs);
    return cpu_has_avx2() && int4_linear_avx2(y, x, qweight, sz, bias, gs);
}

bool int8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& offsets) {
    if (cpu_has_avx512_bf16()) return int8_linear_avx512(y, x, qweight, scales, offsets);
    return cpu_has_avx2() && int8_linear_avx2(y, x, qweight, scales, offsets);
}

}  // namespace tokenmill
