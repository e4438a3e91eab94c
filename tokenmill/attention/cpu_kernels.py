"""A small C++ kernel for decode attention over paged KV blocks on CPU.

Why: the reference decode path gathers every decode's blocks into a contiguous
[B, max_len, Hkv, D] copy (written, then read again by SDPA), and CPU SDPA with a mask is
slow for 3-row queries. This kernel reads each request's K and V once, straight from the
blocks, with one task per (request, KV head) on torch's intra-op thread pool:

    for each (b, h) in parallel:                 h: KV head; its G = Hq / Hkv query heads
        s[g, t] = scale * <q[b, h*G + g], K[block_tables[b, t // bs], t % bs, h]>   t < seq_lens[b]
        p[g, :] = softmax(s[g, :])               (float32)
        out[b, h*G + g] = sum_t p[g, t] * V[...same slot..., h]

Built on first use (layers/cpp_ext.py). If it cannot be built, or TOKENMILL_NO_CPP_KERNELS=1
is set, `paged_decode_attention` returns None and callers keep the pure PyTorch path.
Covered by an exact-oracle test against the reference path (tests/attention).
"""
from __future__ import annotations

import torch

from tokenmill.layers import cpp_ext

_CPP_SOURCE = cpp_ext.EXP16_SOURCE + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>
#include <cmath>
#include <algorithm>
#include <cstring>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }
template <>
inline float to_f<at::BFloat16>(at::BFloat16 x) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f; std::memcpy(&f, &bits, sizeof(f)); return f;
}

template <typename scalar_t, int DC>
static void decode_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
    // q: [B, Hq, D], heads and elements contiguous, rows may be strided; out: [B, Hq, D] contiguous; k/v_cache: [num_blocks, bs, Hkv, D] (strided views ok:
    // the innermost three dims must be contiguous); block_tables [B, nb] int64; seq_lens [B] int64.
    const int64_t B = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2);
    const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
    const int64_t G = Hq / Hkv;
    const int64_t kb_stride = k_cache.stride(0), vb_stride = v_cache.stride(0);
    const int64_t tok_stride = Hkv * D;
    const int64_t nb_max = block_tables.size(1);
    const int64_t q_row = q.stride(0);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t* tp = block_tables.data_ptr<int64_t>();
    const int64_t* sp = seq_lens.data_ptr<int64_t>();
    const float fscale = static_cast<float>(scale);
    // Tasks: one request (all KV heads: token rows are read contiguously) when there are
    // enough requests to fill the threads, else one (request, KV head) pair.
    const int64_t hpt = B >= 2 * at::get_num_threads() ? Hkv : 1;   // KV heads per task
    const int64_t tasks_per_b = Hkv / hpt;
    // Small calls (e.g. one short sequence) run on the calling thread: a parallel region costs
    // more than it saves there, and much more when the cores are shared with other processes.
    int64_t total_tokens = 0;
    for (int64_t b = 0; b < B; ++b) total_tokens += sp[b];
    const int64_t num_tasks = B * tasks_per_b;
    const int64_t grain = total_tokens * Hq * D < (int64_t(1) << 20) ? num_tasks : 1;
    at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(Hkv * G * D), acc(Hkv * G * D), s;
        float kf[512];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / tasks_per_b, h0 = (task % tasks_per_b) * hpt;
            const int64_t L = sp[b];
            const int64_t R = hpt * G;   // query rows handled by this task
            s.assign(R * L, 0.f);
            for (int64_t r = 0; r < R; ++r)
                for (int64_t d = 0; d < D; ++d)
                    qf[r * D + d] = to_f(qp[b * q_row + (h0 * G + r) * D + d]) * fscale;
            // pass 1: scores
            for (int64_t t = 0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + t / bs];
                const scalar_t* kr = kp + blk * kb_stride + (t % bs) * tok_stride + h0 * D;
                for (int64_t hh = 0; hh < hpt; ++hh) {
                    for (int64_t d = 0; d < D; ++d) kf[d] = to_f(kr[hh * D + d]);
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t r = hh * G + g;
                        const float* qg = qf.data() + r * D;
                        float acc_s = 0.f;
                        #pragma omp simd reduction(+:acc_s)
                        for (int64_t d = 0; d < D; ++d) acc_s += qg[d] * kf[d];
                        s[r * L + t] = acc_s;
                    }
                }
            }
            // softmax per query row
            for (int64_t r = 0; r < R; ++r) {
                float* sr = s.data() + r * L;
                float m = -INFINITY;
                for (int64_t t = 0; t < L; ++t) m = std::max(m, sr[t]);
                float sum = 0.f;
                for (int64_t t = 0; t < L; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                for (int64_t t = 0; t < L; ++t) sr[t] *= inv;
            }
            // pass 2: weighted sum of values
            std::fill(acc.begin(), acc.begin() + R * D, 0.f);
            for (int64_t t = 0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + t / bs];
                const scalar_t* vr = vp + blk * vb_stride + (t % bs) * tok_stride + h0 * D;
                for (int64_t hh = 0; hh < hpt; ++hh) {
                    for (int64_t d = 0; d < D; ++d) kf[d] = to_f(vr[hh * D + d]);
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t r = hh * G + g;
                        const float w = s[r * L + t];
                        float* ar = acc.data() + r * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) ar[d] += w * kf[d];
                    }
                }
            }
            for (int64_t r = 0; r < R; ++r)
                for (int64_t d = 0; d < D; ++d)
                    op[(b * Hq + h0 * G + r) * D + d] = static_cast<scalar_t>(acc[r * D + d]);
        }
    });
}


#if defined(__AVX512F__)
#include <immintrin.h>
#include <type_traits>
// Vectorized path for head_dim = 16 * NV (64, 128): K/V rows converted 16 lanes at a time,
// the G query heads of one KV head scored together, exp by a Cephes-style polynomial.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 vectors -> one vector of their 16 lane sums (lane i = sum of v[i]): a transpose-and-add tree,
// ~3 instructions per vector instead of ~9 for a separate horizontal sum each.
static inline __m512 hsum16(const __m512* v) {
    __m512 z[8], w[4], c[2];
    for (int i = 0; i < 8; ++i)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)   // block k of w[i]: 4 partial sums of v[4i + k]
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; ++j)   // block k of c[j]: 2 partials of v[8j + k], then 2 of v[8j + 4 + k]
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // lane 4k + j of r holds the sum of v[k + 4j]
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

template <typename scalar_t, int NV>
static void decode_avx512(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
    constexpr int D = 16 * NV;
    constexpr int GMAX = 8;
    const int64_t B = q.size(0), Hq = q.size(1), bs = k_cache.size(1), Hkv = k_cache.size(2);
    const int64_t G = Hq / Hkv, q_row = q.stride(0), nb_max = block_tables.size(1);
    const int64_t kb_stride = k_cache.stride(0), vb_stride = v_cache.stride(0), tok_stride = Hkv * D;
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t* tp = block_tables.data_ptr<int64_t>();
    const int64_t* sp = seq_lens.data_ptr<int64_t>();
    int64_t work = 0;
    for (int64_t b = 0; b < B; ++b) work += sp[b];
    work *= Hq * D;
    const int64_t num_tasks = B * Hkv;
    const int64_t grain = work < (int64_t(1) << 18) ? num_tasks : 1;   // small calls: no parallel region
    at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> s;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / Hkv, h = task % Hkv, L = sp[b];
            const int64_t Lp = (L + 15) / 16 * 16;
            s.assign(G * Lp, -INFINITY);
            __m512 qv[GMAX][NV];
            for (int64_t g = 0; g < G; ++g)
                for (int i = 0; i < NV; ++i)
                    qv[g][i] = _mm512_mul_ps(load16(qp + b * q_row + (h * G + g) * D + 16 * i),
                                             _mm512_set1_ps(static_cast<float>(scale)));
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
                // bf16: q . k with vdpbf16ps on the stored values (products exact in float32), 16 tokens
                // at a time, their lane sums taken together by hsum16; the scale is applied to the sums.
                const __m512 sv = _mm512_set1_ps(static_cast<float>(scale));
                for (int64_t t0 = 0; t0 < L; t0 += 16) {
                    const int64_t nt = std::min<int64_t>(16, L - t0);
                    const uint16_t* krow[16];
                    for (int64_t i = 0; i < nt; ++i) {
                        const int64_t t = t0 + i;
                        krow[i] = reinterpret_cast<const uint16_t*>(
                            kp + tp[b * nb_max + t / bs] * kb_stride + (t % bs) * tok_stride + h * D);
                    }
                    // The blocks are scattered, so the hardware cannot run ahead: prefetch the next
                    // 16 rows (read cold, this loop ran at ~10 GB/s without it).
                    for (int64_t t = t0 + 16; t < std::min<int64_t>(t0 + 32, L); ++t) {
                        const char* r = reinterpret_cast<const char*>(
                            kp + tp[b * nb_max + t / bs] * kb_stride + (t % bs) * tok_stride + h * D);
                        for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
                    }
                    for (int64_t g = 0; g < G; ++g) {
                        const uint16_t* qg = reinterpret_cast<const uint16_t*>(qp + b * q_row + (h * G + g) * D);
                        __m512bh qb[NV / 2];
                        for (int j = 0; j < NV / 2; ++j) qb[j] = (__m512bh)_mm512_loadu_si512(qg + 32 * j);
                        __m512 acc[16];
                        for (int64_t i = 0; i < 16; ++i) {
                            acc[i] = _mm512_setzero_ps();
                            if (i < nt)
                                for (int j = 0; j < NV / 2; ++j)
                                    acc[i] = _mm512_dpbf16_ps(acc[i], qb[j], (__m512bh)_mm512_loadu_si512(krow[i] + 32 * j));
                        }
                        _mm512_mask_storeu_ps(s.data() + g * Lp + t0, static_cast<__mmask16>((1u << nt) - 1),
                                              _mm512_mul_ps(hsum16(acc), sv));
                    }
                }
            } else
#endif
            for (int64_t t = 0; t < L; ++t) {
                if (t + 16 < L) {  // prefetch 16 rows ahead, as in the bf16 loop
                    const char* r = reinterpret_cast<const char*>(
                        kp + tp[b * nb_max + (t + 16) / bs] * kb_stride + ((t + 16) % bs) * tok_stride + h * D);
                    for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
                }
                const scalar_t* kr = kp + tp[b * nb_max + t / bs] * kb_stride + (t % bs) * tok_stride + h * D;
                __m512 kv[NV];
                for (int i = 0; i < NV; ++i) kv[i] = load16(kr + 16 * i);
                for (int64_t g = 0; g < G; ++g) {
                    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                    for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[g][i], kv[i], acc);
                    s[g * Lp + t] = _mm512_reduce_add_ps(acc);
                }
            }
            float inv[GMAX];
            for (int64_t g = 0; g < G; ++g) {
                float* sr = s.data() + g * Lp;
                __m512 m = _mm512_set1_ps(-INFINITY);
                for (int64_t t = 0; t < Lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + t));
                const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
                __m512 sum = _mm512_setzero_ps();
                for (int64_t t = 0; t < Lp; t += 16) {   // padding lanes are -inf: exp -> 0
                    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + t), mx));
                    e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_loadu_ps(sr + t), _mm512_set1_ps(-INFINITY),
                                                                _CMP_EQ_OQ), e, _mm512_setzero_ps());
                    _mm512_storeu_ps(sr + t, e);
                    sum = _mm512_add_ps(sum, e);
                }
                const float tot = _mm512_reduce_add_ps(sum);
                inv[g] = tot > 0.f ? 1.f / tot : 0.f;
            }
            __m512 acc[GMAX][NV];
            for (int64_t g = 0; g < G; ++g)
                for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
            for (int64_t t = 0; t < L; ++t) {
                if (t + 16 < L) {  // prefetch the row 16 tokens ahead (scattered blocks, see above)
                    const char* r = reinterpret_cast<const char*>(
                        vp + tp[b * nb_max + (t + 16) / bs] * vb_stride + ((t + 16) % bs) * tok_stride + h * D);
                    for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
                }
                const scalar_t* vr = vp + tp[b * nb_max + t / bs] * vb_stride + (t % bs) * tok_stride + h * D;
                __m512 vv[NV];
                for (int i = 0; i < NV; ++i) vv[i] = load16(vr + 16 * i);
                for (int64_t g = 0; g < G; ++g) {
                    const __m512 w = _mm512_set1_ps(s[g * Lp + t]);
                    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(w, vv[i], acc[g][i]);
                }
            }
            float tmp[D];
            for (int64_t g = 0; g < G; ++g) {
                const __m512 sc = _mm512_set1_ps(inv[g]);
                for (int i = 0; i < NV; ++i) _mm512_storeu_ps(tmp + 16 * i, _mm512_mul_ps(acc[g][i], sc));
                scalar_t* o = op + (b * Hq + h * G + g) * D;
                for (int d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(tmp[d]);
            }
        }
    });
}
#define TOKENMILL_AVX512 1
#endif

template <typename scalar_t>
static void write_impl(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                       torch::Tensor slots) {
    // k, v: [T, Hkv, D] (rows may be strided); token t goes to slot slots[t] of the caches.
    const int64_t T = k.size(0), row = k.size(1) * k.size(2), bs = k_cache.size(1);
    const int64_t* sp = slots.data_ptr<int64_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
        const int64_t blk = sp[t] / bs, off = sp[t] % bs;
        std::memcpy(kc + blk * k_cache.stride(0) + off * row, kp + t * k.stride(0), row * sizeof(scalar_t));
        std::memcpy(vc + blk * v_cache.stride(0) + off * row, vp + t * v.stride(0), row * sizeof(scalar_t));
    }
}

static bool inner_contiguous(const torch::Tensor& t) {  // [n, H, D]: heads and elements contiguous
    return t.stride(2) == 1 && t.stride(1) == t.size(2);
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

// Writes the step's new K/V into their slots, then attends (a decode-only batch: one token each).
void write_and_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                      torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, double scale) {
    TORCH_CHECK(inner_contiguous(k) && inner_contiguous(v), "k/v heads must be contiguous");
    TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
    if (k.scalar_type() == at::kFloat) write_impl<float>(k_cache, v_cache, k, v, slots);
    else if (k.scalar_type() == at::kBFloat16) write_impl<at::BFloat16>(k_cache, v_cache, k, v, slots);
    else TORCH_CHECK(false, "write_and_decode: unsupported dtype");
    paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
    TORCH_CHECK(inner_contiguous(q) && out.is_contiguous(), "q heads / out must be contiguous");
    TORCH_CHECK(q.size(2) <= 512, "head_dim > 512");
    TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                k_cache.stride(1) == k_cache.size(2) * k_cache.size(3), "k_cache inner dims must be contiguous");
    TORCH_CHECK(v_cache.stride(3) == 1 && v_cache.stride(2) == v_cache.size(3) &&
                v_cache.stride(1) == v_cache.size(2) * v_cache.size(3), "v_cache inner dims must be contiguous");
    const int64_t D = q.size(2);
#ifdef TOKENMILL_AVX512
    if ((D == 64 || D == 128) && q.size(1) / k_cache.size(2) <= 8) {
        if (q.scalar_type() == at::kFloat) {
            if (D == 64) decode_avx512<float, 4>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
            else decode_avx512<float, 8>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
            return;
        }
        if (q.scalar_type() == at::kBFloat16) {
            if (D == 64) decode_avx512<at::BFloat16, 4>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
            else decode_avx512<at::BFloat16, 8>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
            return;
        }
    }
#endif
    if (q.scalar_type() == at::kFloat) {
        if (D == 64) decode_impl<float, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else if (D == 128) decode_impl<float, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else decode_impl<float, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
    } else if (q.scalar_type() == at::kBFloat16) {
        if (D == 64) decode_impl<at::BFloat16, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else if (D == 128) decode_impl<at::BFloat16, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else decode_impl<at::BFloat16, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
    } else {
        TORCH_CHECK(false, "paged_decode: unsupported dtype");
    }
}
"""

_CPP_DECL = ("void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, "
             "torch::Tensor block_tables, torch::Tensor seq_lens, double scale);\n"
             "void write_and_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, "
             "torch::Tensor slots, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables, "
             "torch::Tensor seq_lens, double scale);")

def _load():
    return cpp_ext.load("tokenmill_cpu_kernels_v10", _CPP_DECL, _CPP_SOURCE, ["paged_decode", "write_and_decode"])


def is_available() -> bool:
    return _load() is not None


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [B, Hq, D]; kv_cache [2, num_blocks, bs, Hkv, D]; block_tables [B, nb] int64; seq_lens [B]
    int64 -> [B, Hq, D], or None when the kernel cannot serve this call (caller falls back)."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or kv_cache.dtype != q.dtype
            or kv_cache.shape[-1] != q.shape[-1]):
        return None
    mod = _load()
    if mod is None:
        return None
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = q.new_empty(q.shape)
    mod.paged_decode(out, q, kv_cache[0], kv_cache[1], block_tables.contiguous(), seq_lens.contiguous(), scale)
    return out


def write_and_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """A decode-only step in one call: write k, v [B, Hkv, D] at slot_mapping [B], then attend as
    `paged_decode_attention`. None (nothing written) when the kernel cannot serve the call."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or kv_cache.dtype != q.dtype
            or k.dtype != q.dtype or v.dtype != q.dtype or kv_cache.shape[-1] != q.shape[-1]
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v))
            or not (block_tables.is_contiguous() and seq_lens.is_contiguous() and slot_mapping.is_contiguous())):
        return None
    mod = _load()
    if mod is None:
        return None
    out = q.new_empty(q.shape)
    mod.write_and_decode(out, q, k, v, slot_mapping, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale)
    return out
