// The GGUF integer kernel for AVX512-VNNI over packed row groups (gguf_layout.h): one vpdpbusd adds 4 products
// to each of 16 rows' int32 lanes, so a unit (32 weights of 16 rows) is 8 of them per activation row, and its
// float epilogue (two FMAs) is paid once per 16 rows and 32 weights.
#include "gguf_layout.h"
#include "gguf_quant.h"

#include "isa/avx512_vnni_begin.h"

namespace tokenmill::gguf {
namespace {

// Activation rows per pass: one int32 accumulator and one float output per row, two code vectors and the scales
// in the 32 vector registers; Q6_K keeps two accumulators per row (its scales cover 16 weights), so fewer rows.
template <GgmlType F>
constexpr int kMaxTile = F == GgmlType::q6_k ? 8 : 12;

// Software prefetch distance: each thread streams its groups' records in order. Prefetching the record 2 KB on
// made passes of 8-32 rows 8-13% faster (docs/gguf.md, "The kernel at several rows"); 8 KB gained less.
constexpr int64_t kPrefetchBytes = 2048;

inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Steps j and j + 4 of a unit (each 4 weights of 16 rows) as unsigned bytes: the low and high nibbles of the
// same 64 bytes, with the high-bit planes of 5- and 6-bit codes; Q8_0's signed bytes + 128.
template <GgmlType F>
inline void step_pair(const uint8_t* unit, int j, __m512i& lo, __m512i& hi) {
    if constexpr (F == GgmlType::q8_0) {
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
        lo = _mm512_xor_si512(_mm512_loadu_si512(unit + 64 * j), flip);
        hi = _mm512_xor_si512(_mm512_loadu_si512(unit + 64 * (j + 4)), flip);
        return;
    } else {
        const __m512i low4 = _mm512_set1_epi8(15);
        const __m512i v = _mm512_loadu_si512(unit + 64 * j);
        lo = _mm512_and_si512(v, low4);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (F == GgmlType::q5_0 || F == GgmlType::q5_k) {
            uint64_t b0, b1;
            std::memcpy(&b0, unit + 256 + 8 * j, 8);
            std::memcpy(&b1, unit + 256 + 8 * (j + 4), 8);
            const __m512i sixteen = _mm512_set1_epi8(16);
            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(static_cast<__mmask64>(b0), sixteen));
            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(static_cast<__mmask64>(b1), sixteen));
        }
        if constexpr (F == GgmlType::q6_k) {
            // 128-bit lane s of step j takes bits 2s, 2s + 1 of the chunk's bytes
            const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
            const __m512i three = _mm512_set1_epi8(3);
            const __m512i c0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 256 + 16 * j)));
            const __m512i c1 =
                _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 256 + 16 * (j + 4))));
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi32(c0, shift), three), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi32(c1, shift), three), 4));
        }
    }
}

inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Two int32 sums per row (steps 0-3 in h0, 4-7 in h1): Q6_K's two scales need them apart, and a tile of fewer
// than 4 rows needs the second chain to hide vpdpbusd's latency. Otherwise one sum per row (h0), so that 12 rows
// fit in the registers.
template <GgmlType F, int MT>
constexpr bool kTwoSums = F == GgmlType::q6_k || MT < 4;

// The int32 dot products of one unit with activation rows m0 .. m0 + MT: with kTwoSums h0[m] sums steps 0-3
// (weights 0-15) and h1[m] steps 4-7, else h0[m] all 8 steps. Steps are taken in pairs, each pair's code vectors
// serving all MT rows, so that no more than two code vectors, the accumulators and the output lanes are live.
// Integer sums are exact: the order of the products does not matter.
template <GgmlType F, int MT>
inline void unit_dots(const uint8_t* unit, const Act& a, int64_t m0, int64_t k0, __m512i (&h0)[MT], __m512i (&h1)[MT]) {
    for (int m = 0; m < MT; ++m) h0[m] = h1[m] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        step_pair<F>(unit, j, lo, hi);
        for (int m = 0; m < MT; ++m) {
            const int8_t* xp = a.q + (m0 + m) * a.K + k0;
            if constexpr (kTwoSums<F, MT>) {
                h0[m] = _mm512_dpbusd_epi32(h0[m], lo, bcast4(xp + 4 * j));
                h1[m] = _mm512_dpbusd_epi32(h1[m], hi, bcast4(xp + 4 * j + 16));
            } else {   // one sum per row: MT independent chains
                h0[m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(h0[m], lo, bcast4(xp + 4 * j)), hi, bcast4(xp + 4 * j + 16));
            }
        }
    }
}

// out[m] (16 rows' float lanes) for activation rows m0 .. m0 + MT over the whole of K: units in order, each
// adding cvt(dot) * (S dx) + Mn ds; the float operations and their order do not depend on MT.
template <GgmlType F, int MT>
inline void group_rows(const uint8_t* grp, const Layout& L, const Act& a, int64_t m0, __m512 (&out)[MT]) {
    for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
    const int64_t nrec = a.K / L.weights, U = a.K / 32;
    const int64_t rec_bytes = L.record();
    for (int64_t b = 0; b < nrec; ++b) {
        const uint8_t* rec = grp + b * rec_bytes;
        // The record kPrefetchBytes ahead (past the group's end: the next group's, which follows it in memory).
        const uint8_t* ahead = rec + kPrefetchBytes;
        for (int64_t off = 0; off < rec_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
        const __m512 d = f16x16(rec);
        __m512 dmin = _mm512_setzero_ps();
        if constexpr (F == GgmlType::q4_1 || F == GgmlType::q4_k || F == GgmlType::q5_k) dmin = f16x16(rec + L.m_off);
        for (int64_t u = 0; u < L.units(); ++u) {
            const uint8_t* unit = rec + L.unit_off + u * L.unit_stride();
            const int64_t k0 = (b * L.units() + u) * 32;
            const int64_t ui = k0 / 32;
            __m512i h0[MT], h1[MT];
            unit_dots<F, MT>(unit, a, m0, k0, h0, h1);
            if constexpr (F == GgmlType::q6_k) {
                const __m512 s0 = _mm512_mul_ps(d, i8x16(rec + L.sc_off + 16 * (2 * u)));
                const __m512 s1 = _mm512_mul_ps(d, i8x16(rec + L.sc_off + 16 * (2 * u + 1)));
                const __m512 n0 = _mm512_mul_ps(s0, _mm512_set1_ps(-32.f)), n1 = _mm512_mul_ps(s1, _mm512_set1_ps(-32.f));
                for (int m = 0; m < MT; ++m) {
                    const int64_t r = m0 + m;
                    const __m512 dx = _mm512_set1_ps(a.dx[r * U + ui]);
                    out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0[m]), _mm512_mul_ps(s0, dx), out[m]);
                    out[m] = _mm512_fmadd_ps(n0, _mm512_set1_ps(a.ds16[r * 2 * U + 2 * ui]), out[m]);
                    out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1[m]), _mm512_mul_ps(s1, dx), out[m]);
                    out[m] = _mm512_fmadd_ps(n1, _mm512_set1_ps(a.ds16[r * 2 * U + 2 * ui + 1]), out[m]);
                }
            } else {
                __m512 s, mn;
                if constexpr (F == GgmlType::q4_k || F == GgmlType::q5_k) {
                    s = _mm512_mul_ps(d, u8x16(rec + L.sc_off + 16 * u));
                    mn = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, u8x16(rec + L.sc_off + 128 + 16 * u)));
                } else if constexpr (F == GgmlType::q4_1) {
                    s = d;
                    mn = dmin;
                } else {
                    constexpr float off = F == GgmlType::q4_0 ? -8.f : F == GgmlType::q5_0 ? -16.f : -128.f;
                    s = d;
                    mn = _mm512_mul_ps(d, _mm512_set1_ps(off));
                }
                for (int m = 0; m < MT; ++m) {
                    const int64_t r = m0 + m;
                    const __m512i dot = kTwoSums<F, MT> ? _mm512_add_epi32(h0[m], h1[m]) : h0[m];
                    out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(a.dx[r * U + ui])), out[m]);
                    out[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.ds[r * U + ui]), out[m]);
                }
            }
        }
    }
}

template <typename T>
inline void store_rows(T* y, int64_t ldy, const __m512& v) {
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int i = 0; i < 16; ++i) y[i] = st<T>(f[i]);
}
template <>
inline void store_rows<float>(float* y, int64_t, const __m512& v) { _mm512_storeu_ps(y, v); }

// Rows m0 .. m0 + t (1 <= t <= MT) of one group.
template <GgmlType F, int MT, typename T>
inline void group_tile(const uint8_t* grp, const Layout& L, const Act& a, int64_t m0, int64_t t, T* y, int64_t ldy) {
    if constexpr (MT > 1) {
        if (t < MT) {
            group_tile<F, MT - 1, T>(grp, L, a, m0, t, y, ldy);
            return;
        }
    }
    __m512 out[MT];
    group_rows<F, MT>(grp, L, a, m0, out);
    for (int m = 0; m < MT; ++m) store_rows<T>(y + (m0 + m) * ldy, ldy, out[m]);
}

template <GgmlType F, typename T>
void run_groups(const uint8_t* packed, int64_t g0, int64_t g1, int64_t group_bytes, const Act& a, int64_t mb,
                int64_t me, T* y, int64_t ldy) {
    const Layout L = layout_of(static_cast<int64_t>(F));
    // Tiles of near-equal rows (9 rows: 5 + 4, not 8 + 1): a tile of one or two rows has too few independent
    // dot-product chains to keep vpdpbusd busy, and costs nearly what a full tile does.
    const int64_t n = me - mb, tiles = (n + kMaxTile<F> - 1) / kMaxTile<F>;
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t i = 0, m0 = mb; i < tiles; ++i) {
            const int64_t t = n / tiles + (i < n % tiles);
            group_tile<F, kMaxTile<F>, T>(packed + g * group_bytes, L, a, m0, t, y + g * kGroupRows, ldy);
            m0 += t;
        }
}

}  // namespace

template <typename T>
bool part_vnni(int64_t type, const uint8_t* packed, int64_t g0, int64_t g1, int64_t group_bytes, const Act& a,
               int64_t mb, int64_t me, T* y, int64_t ldy) {
    switch (static_cast<GgmlType>(type)) {
#define TOKENMILL_GGUF_CASE(t)                                                 \
    case GgmlType::t:                                                          \
        run_groups<GgmlType::t>(packed, g0, g1, group_bytes, a, mb, me, y, ldy); \
        return true;
        TOKENMILL_GGUF_TYPES(TOKENMILL_GGUF_CASE)
#undef TOKENMILL_GGUF_CASE
    }
    return false;
}

template bool part_vnni<float>(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Act&, int64_t, int64_t,
                                float*, int64_t);
template bool part_vnni<at::BFloat16>(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Act&, int64_t,
                                       int64_t, at::BFloat16*, int64_t);

}  // namespace tokenmill::gguf

#include "isa/avx512_end.h"
