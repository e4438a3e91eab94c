// Attention over the paged KV cache on CPU (tokenmill/attention/cpu_kernels.py).
//
// Decode: each request's K and V are read once, straight from the blocks, with one task per (request,
// KV head) on torch's intra-op thread pool:
//
//     for each (b, h) in parallel:                 h: KV head; its G = Hq / Hkv query heads
//         s[g, t] = scale * <q[b, h*G + g], K[block_tables[b, t // bs], t % bs, h]>   t < seq_lens[b]
//         p[g, :] = softmax(s[g, :])               (float32)
//         out[b, h*G + g] = sum_t p[g, t] * V[...same slot..., h]
//
// Prefill (bf16 caches, AVX512-BF16): tiled as in FlashAttention, see prefill_bf16.
// The generic decode loop serves any CPU; the AVX-512 ones are chosen at run time (common.h).
#include "attention.h"

#include <atomic>
#include <memory>
#include <type_traits>

namespace tokenmill {

// ---------------------------------------------------------------------------------- generic code

// Token trees (tokenmill/spec_decode/tree.py): a drafted node attends to its request's prefix and its own
// ancestors, not to the siblings listed before it. Bit j of a token's key mask hides key L - 1 - j (the
// last 64 keys; bit 0, the token itself, is never set): scores of `rows` rows, `stride` apart, set to -inf.
// (The generic loops sum in key order, so the zeros of hidden keys change no bits; the AVX-512 loop sums in
// lanes and compacts instead, see decode_avx512.)
// Where token t of a sequence sits: block t / bs of its table, row t % bs of that block. bs is a power of
// two (CacheConfig checks it), so both are a shift and a mask: the decode loops computed them by 64-bit
// division for every key of every task, ~4 divisions per (key, KV head): per-token prompt attention with
// the keys in cache went 3.65-3.83 -> 2.88-3.31 ns per (head, row, key) on the AMX host without them.
struct BlockGeometry {
    int shift;
    int64_t mask;
    explicit BlockGeometry(int64_t bs) : shift(__builtin_ctzll(static_cast<uint64_t>(bs))), mask(bs - 1) {
        TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "paged attention: block size must be a power of two, got ", bs);
    }
    int64_t block(int64_t t) const { return t >> shift; }
    int64_t row(int64_t t) const { return t & mask; }
};

// Decode attention runs on every thread from this many multiply-adds per call (all rows' keys x heads x dims).
constexpr int64_t kParallelWork = int64_t(1) << 16;

// The batch's rows, most keys first (ties in batch order): the decode loops hand out (row, KV head) tasks in
// this order (parallel_tasks), so the long sequences start first and the short ones fill the gaps.
static std::vector<int64_t> longest_first(const int64_t* seq_lens, int64_t B) {
    std::vector<int64_t> order(B);
    for (int64_t b = 0; b < B; ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return seq_lens[a] > seq_lens[b]; });
    return order;
}

static inline void hide_keys(float* s, int64_t rows, int64_t stride, int64_t L, int64_t mask) {
    const uint64_t bits = static_cast<uint64_t>(mask);
    if (bits == 0) return;
    for (int64_t j = 1; j < std::min<int64_t>(64, L); ++j)
        if ((bits >> j) & 1u)
            for (int64_t r = 0; r < rows; ++r) s[r * stride + L - 1 - j] = -INFINITY;
}

template <typename scalar_t, int DC>
static void decode_impl(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, double scale, const int64_t* km,
                        const int64_t* ks) {
    // q: [B, Hq, D], heads and elements contiguous, rows may be strided; out: [B, Hq, D] contiguous; k/v_cache: [num_blocks, bs, Hkv, D] (strided views ok:
    // the innermost three dims must be contiguous); block_tables [B, nb] int64; seq_lens [B] int64.
    const int64_t B = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2);
    const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
    const BlockGeometry bg(bs);
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
            // Sliding windows: keys before t0 are outside the row's window (their blocks may be gone).
            const int64_t t0 = ks != nullptr ? std::min(std::max<int64_t>(ks[b], 0), L) : 0;
            const int64_t R = hpt * G;   // query rows handled by this task
            s.assign(R * L, 0.f);
            for (int64_t r = 0; r < R; ++r)
                for (int64_t t = 0; t < t0; ++t) s[r * L + t] = -INFINITY;
            for (int64_t r = 0; r < R; ++r)
                for (int64_t d = 0; d < D; ++d)
                    qf[r * D + d] = ld(qp[b * q_row + (h0 * G + r) * D + d]) * fscale;
            // pass 1: scores
            for (int64_t t = t0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + bg.block(t)];
                const scalar_t* kr = kp + blk * kb_stride + bg.row(t) * tok_stride + h0 * D;
                for (int64_t hh = 0; hh < hpt; ++hh) {
                    for (int64_t d = 0; d < D; ++d) kf[d] = ld(kr[hh * D + d]);
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
            if (km != nullptr) hide_keys(s.data(), R, L, L, km[b]);
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
            for (int64_t t = t0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + bg.block(t)];
                const scalar_t* vr = vp + blk * vb_stride + bg.row(t) * tok_stride + h0 * D;
                for (int64_t hh = 0; hh < hpt; ++hh) {
                    for (int64_t d = 0; d < D; ++d) kf[d] = ld(vr[hh * D + d]);
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

template <typename scalar_t>
static void write_impl(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v,
                       at::Tensor slots) {
    // k, v: [T, Hkv, D] (rows may be strided); token t goes to slot slots[t] of the caches.
    const int64_t T = k.size(0), row = k.size(1) * k.size(2), bs = k_cache.size(1);
    const BlockGeometry bg(bs);
    const int64_t* sp = slots.data_ptr<int64_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
        const int64_t blk = bg.block(sp[t]), off = bg.row(sp[t]);
        std::memcpy(kc + blk * k_cache.stride(0) + off * row, kp + t * k.stride(0), row * sizeof(scalar_t));
        std::memcpy(vc + blk * v_cache.stride(0) + off * row, vp + t * v.stride(0), row * sizeof(scalar_t));
    }
}

static bool inner_contiguous(const at::Tensor& t) {  // [n, H, D]: heads and elements contiguous
    return t.stride(2) == 1 && t.stride(1) == t.size(2);
}

// ------------------------------------------------------------------------------------ AVX-512 code
#include "isa/avx512_begin.h"
#include "vec_avx512.h"


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

// How far ahead the decode loops prefetch K/V rows. Batch 64 x 100-700 tokens, bf16, read cold
// (30 layers' caches in turn): 16 rows ahead 1,200 us per layer, 32: 1,000, 48: 930, 64: 960, 96: 1,050.
constexpr int64_t PF_AHEAD = 48;

// Vectorized decode for head_dim = 16 * NV (64, 128): K/V rows converted 16 lanes at a time, the G
// query heads of one KV head scored together, exp by a Cephes-style polynomial. BF16_DOT (bf16 caches on
// AVX512-BF16 CPUs): q . k by vdpbf16ps on the stored values.

template <typename scalar_t, int NV, bool BF16_DOT>
static void decode_avx512(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                          at::Tensor block_tables, at::Tensor seq_lens, double scale, const int64_t* km) {
    constexpr int D = 16 * NV;
    constexpr int GMAX = 8;
    const int64_t B = q.size(0), Hq = q.size(1), bs = k_cache.size(1), Hkv = k_cache.size(2);
    const BlockGeometry bg(bs);
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
    // A task is one row's KV heads, read one after the other (their K/V share cache lines' neighbours and
    // the prefetchers' streams), when there are rows enough to fill the threads; else one (row, KV head).
    const int64_t hpt = B >= 2 * at::get_num_threads() ? Hkv : 1, tasks_per_b = Hkv / hpt;
    const int64_t num_tasks = B * tasks_per_b;
    const std::vector<int64_t> order = longest_first(sp, B);
    // Below 2^16 multiply-adds (batch 1 of SmolLM2: ~114 keys) one thread; from there the KV heads split over
    // the threads. At 2^18 (until 2026-12-07) batch 1 stayed on one thread up to ~455 keys while the other
    // spun: lowering it made 140-400-key decode steps 6-10% faster (docs/cpu_decode.md, item 29).
    parallel_tasks(num_tasks, work >= kParallelWork, [&](const auto& next) {
        std::vector<float> s;
        for (int64_t task = next(); task >= 0; task = next())
        for (int64_t h = (task % tasks_per_b) * hpt; h < (task % tasks_per_b + 1) * hpt; ++h) {
            const int64_t b = order[task / tasks_per_b], L = sp[b];
            const int64_t Lp = (L + 15) / 16 * 16;
            s.assign(G * Lp, -INFINITY);
            for (int64_t t = 0; t < std::min<int64_t>(PF_AHEAD, L); ++t) {   // the rows the loops start on
                const char* kr = reinterpret_cast<const char*>(kp + tp[b * nb_max + bg.block(t)] * kb_stride + bg.row(t) * tok_stride + h * D);
                const char* vr = reinterpret_cast<const char*>(vp + tp[b * nb_max + bg.block(t)] * vb_stride + bg.row(t) * tok_stride + h * D);
                for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) {
                    _mm_prefetch(kr + off, _MM_HINT_T0);
                    _mm_prefetch(vr + off, _MM_HINT_T1);
                }
            }
            __m512 qv[GMAX][NV];
            for (int64_t g = 0; g < G; ++g)
                for (int i = 0; i < NV; ++i)
                    qv[g][i] = _mm512_mul_ps(load16(qp + b * q_row + (h * G + g) * D + 16 * i),
                                             _mm512_set1_ps(static_cast<float>(scale)));
            if constexpr (BF16_DOT && std::is_same_v<scalar_t, at::BFloat16>) {
                // bf16: q . k with vdpbf16ps on the stored values (products exact in float32), 16 tokens
                // at a time, their lane sums taken together by hsum16; the scale is applied to the sums.
                const __m512 sv = _mm512_set1_ps(static_cast<float>(scale));
                for (int64_t t0 = 0; t0 < L; t0 += 16) {
                    const int64_t nt = std::min<int64_t>(16, L - t0);
                    const uint16_t* krow[16];
                    for (int64_t i = 0; i < nt; ++i) {
                        const int64_t t = t0 + i;
                        krow[i] = reinterpret_cast<const uint16_t*>(
                            kp + tp[b * nb_max + bg.block(t)] * kb_stride + bg.row(t) * tok_stride + h * D);
                    }
                    // The blocks are scattered, so the hardware cannot run ahead: prefetch 16 rows,
                    // PF_AHEAD rows ahead (read cold, this loop ran at ~10 GB/s without it).
                    for (int64_t t = t0 + PF_AHEAD; t < std::min<int64_t>(t0 + PF_AHEAD + 16, L); ++t) {
                        const char* r = reinterpret_cast<const char*>(
                            kp + tp[b * nb_max + bg.block(t)] * kb_stride + bg.row(t) * tok_stride + h * D);
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
            for (int64_t t = 0; t < L; ++t) {
                if (t + PF_AHEAD < L) {  // prefetch PF_AHEAD rows ahead, as in the bf16 loop
                    const char* r = reinterpret_cast<const char*>(
                        kp + tp[b * nb_max + bg.block(t + PF_AHEAD)] * kb_stride + bg.row(t + PF_AHEAD) * tok_stride + h * D);
                    for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
                }
                const scalar_t* kr = kp + tp[b * nb_max + bg.block(t)] * kb_stride + bg.row(t) * tok_stride + h * D;
                __m512 kv[NV];
                for (int i = 0; i < NV; ++i) kv[i] = load16(kr + 16 * i);
                for (int64_t g = 0; g < G; ++g) {
                    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                    for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[g][i], kv[i], acc);
                    s[g * Lp + t] = _mm512_reduce_add_ps(acc);
                }
            }
            // A tree node's hidden keys are dropped from its scores (not only set to -inf): its visible keys
            // then sit in the lanes a plain decode of the same path gives them, so the softmax sums round
            // alike and an accepted node's K/V are bitwise what decoding would have written.
            int64_t Lv = L, tail0 = L;
            int64_t tail[64];
            if (km != nullptr && km[b] != 0) {
                const uint64_t bits = static_cast<uint64_t>(km[b]);
                tail0 = std::max<int64_t>(0, L - 64);
                int64_t n = 0;
                for (int64_t t = tail0; t < L; ++t)
                    if (!((bits >> (L - 1 - t)) & 1u)) tail[n++] = t;
                for (int64_t g = 0; g < G; ++g) {
                    float* sr = s.data() + g * Lp;
                    for (int64_t i = 0; i < n; ++i) sr[tail0 + i] = sr[tail[i]];   // tail[i] >= tail0 + i
                    for (int64_t t = tail0 + n; t < L; ++t) sr[t] = -INFINITY;
                }
                Lv = tail0 + n;
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
            for (int64_t t = 0; t < Lv; ++t) {
                if (t + PF_AHEAD < L) {  // prefetch the row PF_AHEAD tokens ahead (scattered blocks, see above)
                    const char* r = reinterpret_cast<const char*>(
                        vp + tp[b * nb_max + bg.block(t + PF_AHEAD)] * vb_stride + bg.row(t + PF_AHEAD) * tok_stride + h * D);
                    for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
                }
                const int64_t ts = t < tail0 ? t : tail[t - tail0];   // the key's slot (tree nodes: compacted)
                const scalar_t* vr = vp + tp[b * nb_max + bg.block(ts)] * vb_stride + bg.row(ts) * tok_stride + h * D;
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

// Prefill attention for bf16 caches, tiled as in FlashAttention: a tile of RT query rows (token,
// head pairs of one KV head) against 64 keys at a time, online softmax, both products by vdpbf16ps.
// Per (query row, key) this costs ~4 vdpbf16ps plus the softmax, against ~12 instructions when
// every prompt token is attended as its own decode (horizontal sums per key).
//
// Phase 1 packs each sequence's keys and values, 16 keys and one KV head per block of 8*D uint32:
//   K block [D/2][16]: lane j of row p = (k[j][2p], k[j][2p+1])   -> q.k: broadcast a pair of q
//   V block [8][D]:    lane d of row i = (v[2i][d], v[2i+1][d])   -> p.V: broadcast a pair of p
// Keys past seq_len are zero and masked. Phase 2 runs (sequence, KV head, row tile) tasks, heaviest
// first, taken from a shared counter so a long prompt's tail cannot leave a thread idle.
// Numerics: scores and softmax in float32 as in the decode kernel; the probabilities are rounded
// to bf16 for p.V (as GPU flash kernels do), so results agree with the decode path to bf16 accuracy,
// not bit for bit.
template <int NV>
static void prefill_bf16(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor block_tables, at::Tensor seq_lens, at::Tensor q_start,
                         at::Tensor q_len, double scale) {
    constexpr int D = 16 * NV, P2 = D / 2, RT = 4, KT = 4, BLK = 8 * D;
    const int64_t S = seq_lens.size(0), Hq = q.size(1), bs = k_cache.size(1), Hkv = k_cache.size(2);
    const BlockGeometry bg(bs);
    const int64_t G = Hq / Hkv, q_row = q.stride(0), nb_max = block_tables.size(1);
    const int64_t kb_stride = k_cache.stride(0), vb_stride = v_cache.stride(0), tok_stride = Hkv * D;
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    const int64_t* tp = block_tables.data_ptr<int64_t>();
    const int64_t* sp = seq_lens.data_ptr<int64_t>();
    const int64_t* qs = q_start.data_ptr<int64_t>();
    const int64_t* ql = q_len.data_ptr<int64_t>();
    std::vector<int64_t> boff(S + 1, 0);           // first packed 16-key block of each sequence
    for (int64_t s = 0; s < S; ++s) boff[s + 1] = boff[s] + (sp[s] + 15) / 16;
    const int64_t nblk = boff[S];
    // + KT blocks of zeros at the end: a tile may read up to KT - 1 blocks past its sequence. Every
    // other entry is written by the packing below (key lanes past seq_len as zeros), so only that
    // tail is cleared here.
    const int64_t pack_len = (nblk + KT) * Hkv * BLK, tail = nblk * Hkv * BLK;
    std::unique_ptr<uint32_t[]> kbuf(new uint32_t[pack_len]), vbuf(new uint32_t[pack_len]);
    std::fill(kbuf.get() + tail, kbuf.get() + pack_len, 0u);
    std::fill(vbuf.get() + tail, vbuf.get() + pack_len, 0u);
    const uint32_t* kpack_data = kbuf.get();
    const uint32_t* vpack_data = vbuf.get();
    static const uint16_t zeros[512] = {0};

    at::parallel_for(0, nblk, 8, [&](int64_t b0, int64_t b1) {
        for (int64_t idx = b0; idx < b1; ++idx) {
            const int64_t s = std::upper_bound(boff.begin(), boff.end(), idx) - boff.begin() - 1;
            const int64_t t0 = (idx - boff[s]) * 16, nk = std::min<int64_t>(16, sp[s] - t0);
            const uint16_t* krow[16];
            const uint16_t* vrow[16];
            for (int64_t j = 0; j < 16; ++j) {
                if (j < nk) {
                    const int64_t t = t0 + j, blk = tp[s * nb_max + bg.block(t)];
                    krow[j] = kp + blk * kb_stride + bg.row(t) * tok_stride;
                    vrow[j] = vp + blk * vb_stride + bg.row(t) * tok_stride;
                } else {
                    krow[j] = vrow[j] = nullptr;
                }
            }
            for (int64_t h = 0; h < Hkv; ++h) {
                uint32_t* kd = kbuf.get() + (idx * Hkv + h) * BLK;
                for (int64_t j = 0; j < nk; ++j) {
                    const uint32_t* src = reinterpret_cast<const uint32_t*>(krow[j] + h * D);
                    for (int p = 0; p < P2; ++p) kd[p * 16 + j] = src[p];
                }
                for (int64_t j = nk; j < 16; ++j)
                    for (int p = 0; p < P2; ++p) kd[p * 16 + j] = 0u;
                uint32_t* vd = vbuf.get() + (idx * Hkv + h) * BLK;
                for (int i = 0; i < 8; ++i) {
                    const uint16_t* a = 2 * i < nk ? vrow[2 * i] + h * D : zeros;
                    const uint16_t* b = 2 * i + 1 < nk ? vrow[2 * i + 1] + h * D : zeros;
                    for (int c = 0; c < NV; ++c) {
                        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * c)));
                        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * c)));
                        _mm512_storeu_si512(vd + i * D + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                    }
                }
            }
        }
    });

    struct Task { int64_t s, h, r0; };
    std::vector<Task> tasks;
    for (int64_t s = 0; s < S; ++s)
        for (int64_t r0 = (ql[s] * G - 1) / RT * RT; r0 >= 0; r0 -= RT)   // last rows (most keys) first
            for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({s, h, r0});
    std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
        return sp[a.s] - ql[a.s] + a.r0 / G > sp[b.s] - ql[b.s] + b.r0 / G; });
    std::atomic<int64_t> next{0};
    const int64_t ntasks = static_cast<int64_t>(tasks.size());
    const __m512 sv = _mm512_set1_ps(static_cast<float>(scale));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), ntasks), 1, [&](int64_t, int64_t) {
        alignas(64) float O[RT][D];
        alignas(64) uint32_t Pp[RT][KT * 8];
        for (int64_t ti = next.fetch_add(1); ti < ntasks; ti = next.fetch_add(1)) {
            const Task tk = tasks[ti];
            const int64_t s = tk.s, h = tk.h, nrows = ql[s] * G, pos0 = sp[s] - ql[s];
            const int nr = static_cast<int>(std::min<int64_t>(RT, nrows - tk.r0));
            const uint32_t* qr[RT];
            int64_t pos[RT];
            for (int rr = 0; rr < RT; ++rr) {   // padding rows repeat the last real one
                const int64_t r = tk.r0 + std::min(rr, nr - 1), i = r / G, g = r % G;
                qr[rr] = reinterpret_cast<const uint32_t*>(qp + (qs[s] + i) * q_row + (h * G + g) * D);
                pos[rr] = pos0 + i;
            }
            const int64_t kend = pos[RT - 1] + 1;   // keys [0, kend) are visible to some row
            float m[RT];
            __m512 lsum[RT];
            for (int rr = 0; rr < RT; ++rr) {
                m[rr] = -INFINITY;
                lsum[rr] = _mm512_setzero_ps();
                for (int d = 0; d < D; ++d) O[rr][d] = 0.f;
            }
            const uint32_t* kbase = kpack_data + (boff[s] * Hkv + h) * BLK;
            const uint32_t* vbase = vpack_data + (boff[s] * Hkv + h) * BLK;
            const int64_t hstride = Hkv * BLK;   // from one 16-key block to the next (same head)
            for (int64_t t0 = 0; t0 < kend; t0 += 16 * KT) {
                const int64_t kb0 = t0 / 16;
                const int nsb = static_cast<int>(std::min<int64_t>(KT, (kend - t0 + 15) / 16));
                __m512 acc[RT][KT];
                for (int rr = 0; rr < RT; ++rr)
                    for (int sb = 0; sb < KT; ++sb) acc[rr][sb] = _mm512_setzero_ps();
                const uint32_t* kb = kbase + kb0 * hstride;
                for (int p = 0; p < P2; ++p) {
                    __m512bh kv[KT];
                    for (int sb = 0; sb < KT; ++sb)
                        kv[sb] = (__m512bh)_mm512_loadu_si512(kb + sb * hstride + p * 16);
                    for (int rr = 0; rr < RT; ++rr) {
                        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[rr][p]));
                        for (int sb = 0; sb < KT; ++sb) acc[rr][sb] = _mm512_dpbf16_ps(acc[rr][sb], qb, kv[sb]);
                    }
                }
                float alpha[RT];
                for (int rr = 0; rr < RT; ++rr) {
                    __mmask16 valid[KT];
                    __m512 mx = _mm512_set1_ps(-INFINITY);
                    for (int sb = 0; sb < KT; ++sb) {
                        valid[sb] = _mm512_cmp_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t0 + 16 * sb))),
                                                          _mm512_set1_epi32(static_cast<int>(pos[rr])), _MM_CMPINT_LE);
                        acc[rr][sb] = _mm512_mask_blend_ps(valid[sb], _mm512_set1_ps(-INFINITY), _mm512_mul_ps(acc[rr][sb], sv));
                        mx = _mm512_max_ps(mx, acc[rr][sb]);
                    }
                    const float mt = _mm512_reduce_max_ps(mx);
                    if (mt == -INFINITY) {   // no visible key in this tile for this row
                        alpha[rr] = 1.f;
                        for (int i = 0; i < KT * 8; ++i) Pp[rr][i] = 0u;
                        continue;
                    }
                    const float mn = std::max(m[rr], mt);
                    alpha[rr] = std::exp(m[rr] - mn);   // exp(-inf) = 0 on the first tile
                    m[rr] = mn;
                    const __m512 mv = _mm512_set1_ps(mn);
                    __m512 e[KT];
                    __m512 tot = _mm512_setzero_ps();
                    for (int sb = 0; sb < KT; ++sb) {
                        e[sb] = _mm512_maskz_mov_ps(valid[sb], exp16(_mm512_sub_ps(acc[rr][sb], mv)));
                        tot = _mm512_add_ps(tot, e[sb]);
                    }
                    lsum[rr] = _mm512_fmadd_ps(lsum[rr], _mm512_set1_ps(alpha[rr]), tot);
                    for (int sb = 0; sb < KT; sb += 2)
                        _mm512_storeu_si512(Pp[rr] + sb * 8, (__m512i)_mm512_cvtne2ps_pbh(e[sb + 1], e[sb]));
                }
                for (int c0 = 0; c0 < NV; c0 += 4) {
                    __m512 o[RT][4];
                    for (int rr = 0; rr < RT; ++rr) {
                        const __m512 a = _mm512_set1_ps(alpha[rr]);
                        for (int c = 0; c < 4; ++c) o[rr][c] = _mm512_mul_ps(_mm512_load_ps(O[rr] + 16 * (c0 + c)), a);
                    }
                    for (int i = 0; i < nsb * 8; ++i) {   // key pairs (t0 + 2i, t0 + 2i + 1)
                        const uint32_t* vr = vbase + (kb0 + i / 8) * hstride + (i % 8) * D + 16 * c0;
                        __m512bh pb[RT];
                        for (int rr = 0; rr < RT; ++rr) pb[rr] = (__m512bh)_mm512_set1_epi32(static_cast<int>(Pp[rr][i]));
                        for (int c = 0; c < 4; ++c) {
                            const __m512bh v = (__m512bh)_mm512_loadu_si512(vr + 16 * c);
                            for (int rr = 0; rr < RT; ++rr) o[rr][c] = _mm512_dpbf16_ps(o[rr][c], pb[rr], v);
                        }
                    }
                    for (int rr = 0; rr < RT; ++rr)
                        for (int c = 0; c < 4; ++c) _mm512_store_ps(O[rr] + 16 * (c0 + c), o[rr][c]);
                }
            }
            for (int rr = 0; rr < nr; ++rr) {
                const int64_t r = tk.r0 + rr, i = r / G, g = r % G;
                const float inv = 1.f / _mm512_reduce_add_ps(lsum[rr]);
                at::BFloat16* dst = op + ((qs[s] + i) * Hq + h * G + g) * D;
                for (int d = 0; d < D; ++d) dst[d] = static_cast<at::BFloat16>(O[rr][d] * inv);
            }
        }
    });
}

#include "isa/avx512_end.h"

// -------------------------------------------------------------------------------------- AVX2 code
#include "isa/avx2_begin.h"
#include "vec_avx2.h"

// 8 vectors -> one vector of their 8 lane sums (lane i = sum of v[i]): two rounds of hadd, then the two
// 128-bit halves of each partial added.
static inline __m256 hsum8(const __m256* v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // ab: lanes 0-3 hold v0..v3's sums of elements 0-3, lanes 4-7 the same of elements 4-7; cd for v4..v7
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Decode for head_dim = 8 * NV (64, 128) on AVX2 + FMA CPUs, decode_avx512's algorithm in 8 lanes: each
// (request, KV head) task converts 8 keys' rows to float32 once and scores them against the G query heads
// (8 dot products summed together by hsum8), softmax by exp8, then p.V. Per task the sums run in one
// order whatever the batch or the thread split, so a request's output does not depend on its neighbours.
template <typename scalar_t, int NV>
static void decode_avx2(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, double scale, const int64_t* km) {
    constexpr int D = 8 * NV;
    constexpr int GMAX = 8;
    const int64_t B = q.size(0), Hq = q.size(1), bs = k_cache.size(1), Hkv = k_cache.size(2);
    const BlockGeometry bg(bs);
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
    // A task is one row's KV heads, read one after the other (their K/V share cache lines' neighbours and
    // the prefetchers' streams), when there are rows enough to fill the threads; else one (row, KV head).
    const int64_t hpt = B >= 2 * at::get_num_threads() ? Hkv : 1, tasks_per_b = Hkv / hpt;
    const int64_t num_tasks = B * tasks_per_b;
    const std::vector<int64_t> order = longest_first(sp, B);
    const float fscale = static_cast<float>(scale);
    parallel_tasks(num_tasks, work >= kParallelWork, [&](const auto& next) {   // as decode_avx512
        std::vector<float> s, acc(GMAX * D);
        std::vector<int64_t> krow, vrow;   // each key's row offset in the K and V caches
        alignas(32) float qf[GMAX * D];
        alignas(32) float kf[8 * D];
        for (int64_t task = next(); task >= 0; task = next())
        for (int64_t h = (task % tasks_per_b) * hpt; h < (task % tasks_per_b + 1) * hpt; ++h) {
            const int64_t b = order[task / tasks_per_b], L = sp[b];
            const int64_t Lp = (L + 7) / 8 * 8;
            krow.resize(L);
            vrow.resize(L);
            for (int64_t t = 0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + bg.block(t)], in = bg.row(t) * tok_stride + h * D;
                krow[t] = blk * kb_stride + in;
                vrow[t] = blk * vb_stride + in;
            }
            for (int64_t t = 0; t < std::min<int64_t>(PF_AHEAD, L); ++t)   // the rows the loops start on
                for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64) {
                    _mm_prefetch(reinterpret_cast<const char*>(kp + krow[t]) + off, _MM_HINT_T0);
                    _mm_prefetch(reinterpret_cast<const char*>(vp + vrow[t]) + off, _MM_HINT_T1);
                }
            for (int64_t g = 0; g < G; ++g)
                for (int i = 0; i < NV; ++i)
                    _mm256_store_ps(qf + g * D + 8 * i, _mm256_mul_ps(load8(qp + b * q_row + (h * G + g) * D + 8 * i),
                                                                      _mm256_set1_ps(fscale)));
            s.assign(G * Lp, -INFINITY);
            std::fill(kf, kf + 8 * D, 0.f);
            // pass 1: scores, 8 keys at a time
            for (int64_t t0 = 0; t0 < L; t0 += 8) {
                const int64_t nt = std::min<int64_t>(8, L - t0);
                for (int64_t t = t0 + PF_AHEAD; t < std::min<int64_t>(t0 + PF_AHEAD + 8, L); ++t)
                    for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64)
                        _mm_prefetch(reinterpret_cast<const char*>(kp + krow[t]) + off, _MM_HINT_T0);
                for (int64_t i = 0; i < nt; ++i)
                    for (int j = 0; j < NV; ++j) _mm256_store_ps(kf + i * D + 8 * j, load8(kp + krow[t0 + i] + 8 * j));
                for (int64_t g = 0; g < G; ++g) {
                    const float* qg = qf + g * D;
                    __m256 a[8];
                    for (int i = 0; i < 8; ++i) {
                        a[i] = _mm256_mul_ps(_mm256_load_ps(qg), _mm256_load_ps(kf + i * D));
                        for (int j = 1; j < NV; ++j)
                            a[i] = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * j), _mm256_load_ps(kf + i * D + 8 * j), a[i]);
                    }
                    _mm256_storeu_ps(s.data() + g * Lp + t0, hsum8(a));
                }
            }
            for (int64_t g = 0; g < G; ++g)   // the last group's unused lanes
                for (int64_t t = L; t < Lp; ++t) s[g * Lp + t] = -INFINITY;
            // Tree nodes: hidden keys dropped from the scores and the rest compacted, as in decode_avx512.
            int64_t Lv = L, tail0 = L;
            int64_t tail[64];
            if (km != nullptr && km[b] != 0) {
                const uint64_t bits = static_cast<uint64_t>(km[b]);
                tail0 = std::max<int64_t>(0, L - 64);
                int64_t n = 0;
                for (int64_t t = tail0; t < L; ++t)
                    if (!((bits >> (L - 1 - t)) & 1u)) tail[n++] = t;
                for (int64_t g = 0; g < G; ++g) {
                    float* sr = s.data() + g * Lp;
                    for (int64_t i = 0; i < n; ++i) sr[tail0 + i] = sr[tail[i]];   // tail[i] >= tail0 + i
                    for (int64_t t = tail0 + n; t < L; ++t) sr[t] = -INFINITY;
                }
                Lv = tail0 + n;
            }
            float inv[GMAX];
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            for (int64_t g = 0; g < G; ++g) {
                float* sr = s.data() + g * Lp;
                __m256 m = ninf;
                for (int64_t t = 0; t < Lp; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sr + t));
                alignas(32) float mv[8];
                _mm256_store_ps(mv, m);
                const __m256 mx = _mm256_set1_ps(*std::max_element(mv, mv + 8));
                __m256 sum = _mm256_setzero_ps();
                for (int64_t t = 0; t < Lp; t += 8) {   // -inf (padding, hidden keys) -> exactly 0
                    const __m256 x = _mm256_loadu_ps(sr + t);
                    const __m256 e = _mm256_blendv_ps(exp8(_mm256_sub_ps(x, mx)), _mm256_setzero_ps(),
                                                      _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
                    _mm256_storeu_ps(sr + t, e);
                    sum = _mm256_add_ps(sum, e);
                }
                alignas(32) float sv[8];
                _mm256_store_ps(sv, sum);
                float tot = 0.f;
                for (int i = 0; i < 8; ++i) tot += sv[i];
                inv[g] = tot > 0.f ? 1.f / tot : 0.f;
            }
            // pass 2: p.V
            std::fill(acc.begin(), acc.begin() + G * D, 0.f);
            for (int64_t t = 0; t < Lv; ++t) {
                if (t + PF_AHEAD < L)
                    for (int64_t off = 0; off < D * (int64_t)sizeof(scalar_t); off += 64)
                        _mm_prefetch(reinterpret_cast<const char*>(vp + vrow[t + PF_AHEAD]) + off, _MM_HINT_T0);
                const int64_t ts = t < tail0 ? t : tail[t - tail0];   // the key's slot (tree nodes: compacted)
                const scalar_t* vr = vp + vrow[ts];
                __m256 vv[NV];
                for (int i = 0; i < NV; ++i) vv[i] = load8(vr + 8 * i);
                for (int64_t g = 0; g < G; ++g) {
                    const __m256 w = _mm256_set1_ps(s[g * Lp + t]);
                    float* ag = acc.data() + g * D;
                    for (int i = 0; i < NV; ++i)
                        _mm256_storeu_ps(ag + 8 * i, _mm256_fmadd_ps(w, vv[i], _mm256_loadu_ps(ag + 8 * i)));
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                scalar_t* o = op + (b * Hq + h * G + g) * D;
                for (int d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] * inv[g]);
            }
        }
    });
}

#include "isa/avx2_end.h"

// Which loop paged_decode runs for these operands at the instruction-set level in force.
DecodeKernel decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, bool windowed) {
    const int64_t D = q.size(2), G = q.size(1) / k_cache.size(2);
    const bool shaped = !windowed && (D == 64 || D == 128) && G <= 8 &&
                        (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16);
    // NOTE: windowed rows (key_start) take the generic loop: the vector ones have no window start yet.
    if (shaped && cpu_has_avx512())
        return q.scalar_type() == at::kBFloat16 && cpu_has_avx512_bf16() ? DecodeKernel::avx512_bf16 : DecodeKernel::avx512;
    if (shaped && cpu_has_avx2()) return DecodeKernel::avx2;
    return DecodeKernel::generic;
}

const char* decode_kernel_name(DecodeKernel k) {
    switch (k) {
        case DecodeKernel::avx512_bf16: return "avx512_bf16";
        case DecodeKernel::avx512: return "avx512";
        case DecodeKernel::avx2: return "avx2";
        default: return "generic";
    }
}

// ------------------------------------------------------------------------------------ entry points

bool paged_prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_start,
                   const at::Tensor& q_len, double scale) {
    const int64_t D = q.size(2);
    if (!cpu_has_avx512_bf16() || q.scalar_type() != at::kBFloat16 || k_cache.scalar_type() != at::kBFloat16 ||
        v_cache.scalar_type() != at::kBFloat16 || !(D == 64 || D == 128) || q.size(1) % k_cache.size(2) != 0)
        return false;
    TORCH_CHECK(inner_contiguous(q) && out.is_contiguous(), "q heads / out must be contiguous");
    TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == D && k_cache.stride(1) == k_cache.size(2) * D &&
                v_cache.stride(3) == 1 && v_cache.stride(2) == D && v_cache.stride(1) == v_cache.size(2) * D,
                "k/v_cache inner dims must be contiguous");
    if (D == 64) prefill_bf16<4>(out, q, k_cache, v_cache, block_tables, seq_lens, q_start, q_len, scale);
    else prefill_bf16<8>(out, q, k_cache, v_cache, block_tables, seq_lens, q_start, q_len, scale);
    return true;
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& key_start) {
    TORCH_CHECK(inner_contiguous(q) && out.is_contiguous(), "q heads / out must be contiguous");
    const int64_t* km = nullptr;
    const int64_t* ks = nullptr;
    if (key_start.has_value()) {
        TORCH_CHECK(key_start->scalar_type() == at::kLong && key_start->is_contiguous() &&
                    key_start->numel() == q.size(0), "key_start must be [B] int64, contiguous");
        ks = key_start->data_ptr<int64_t>();
    }
    if (key_mask.has_value()) {
        TORCH_CHECK(key_mask->scalar_type() == at::kLong && key_mask->is_contiguous() &&
                    key_mask->numel() == q.size(0), "key_mask must be [B] int64, contiguous");
        km = key_mask->data_ptr<int64_t>();
    }
    TORCH_CHECK(q.size(2) <= 512, "head_dim > 512");
    TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                k_cache.stride(1) == k_cache.size(2) * k_cache.size(3), "k_cache inner dims must be contiguous");
    TORCH_CHECK(v_cache.stride(3) == 1 && v_cache.stride(2) == v_cache.size(3) &&
                v_cache.stride(1) == v_cache.size(2) * v_cache.size(3), "v_cache inner dims must be contiguous");
    const int64_t D = q.size(2);
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    switch (decode_kernel(q, k_cache, ks != nullptr)) {
        case DecodeKernel::avx512_bf16:
            if (D == 64) decode_avx512<at::BFloat16, 4, true>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else decode_avx512<at::BFloat16, 8, true>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            return;
        case DecodeKernel::avx512:
            if (bf16 && D == 64) decode_avx512<at::BFloat16, 4, false>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else if (bf16) decode_avx512<at::BFloat16, 8, false>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else if (D == 64) decode_avx512<float, 4, false>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else decode_avx512<float, 8, false>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            return;
        case DecodeKernel::avx2:
            if (bf16 && D == 64) decode_avx2<at::BFloat16, 8>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else if (bf16) decode_avx2<at::BFloat16, 16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else if (D == 64) decode_avx2<float, 8>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            else decode_avx2<float, 16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km);
            return;
        case DecodeKernel::generic:
            break;
    }
    if (q.scalar_type() == at::kFloat) {
        if (D == 64) decode_impl<float, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km, ks);
        else if (D == 128) decode_impl<float, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km, ks);
        else decode_impl<float, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km, ks);
    } else if (q.scalar_type() == at::kBFloat16) {
        if (D == 64) decode_impl<at::BFloat16, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km, ks);
        else if (D == 128) decode_impl<at::BFloat16, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km, ks);
        else decode_impl<at::BFloat16, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, km, ks);
    } else {
        TORCH_CHECK(false, "paged_decode: unsupported dtype");
    }
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(inner_contiguous(k) && inner_contiguous(v), "k/v heads must be contiguous");
    TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
    if (k.scalar_type() == at::kFloat) write_impl<float>(k_cache, v_cache, k, v, slots);
    else if (k.scalar_type() == at::kBFloat16) write_impl<at::BFloat16>(k_cache, v_cache, k, v, slots);
    else TORCH_CHECK(false, "write_kv: unsupported dtype");
}

// Writes the step's new K/V into their slots, then attends (a decode-only batch: one token each).
void write_and_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& key_mask,
                      const std::optional<at::Tensor>& key_start) {
    write_kv(k, v, slots, k_cache, v_cache);
    paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, scale, key_mask, key_start);
}

}  // namespace tokenmill
