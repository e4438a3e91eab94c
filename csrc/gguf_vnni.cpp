// The GGUF integer kernel for AVX512-VNNI over packed row groups (gguf_layout.h): one vpdpbusd adds 4 products
// to each of 16 rows' int32 lanes, so a unit (32 weights of 16 rows) is 8 of them per activation row, and its
// float epilogue (two FMAs) is paid once per 16 rows and 32 weights.
#include "gguf_layout.h"
#include "gguf_quant.h"

#include "isa/avx512_vnni_begin.h"

namespace tokenmill::gguf {
namespace {

constexpr int kMaxTile = 8;   // activation rows per pass: 8 code vectors, 8 accumulators and the scales

inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A unit's 8 code vectors (step j: 4 weights of 16 rows) as unsigned bytes; Q8_0's signed bytes + 128.
template <GgmlType F>
inline void unit_codes(const uint8_t* unit, __m512i (&c)[8]) {
    if constexpr (F == GgmlType::q8_0) {
        for (int j = 0; j < 8; ++j)
            c[j] = _mm512_xor_si512(_mm512_loadu_si512(unit + 64 * j), _mm512_set1_epi8(static_cast<char>(0x80)));
        return;
    } else {
        const __m512i low4 = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512(unit + 64 * j);
            c[j] = _mm512_and_si512(v, low4);
            c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if constexpr (F == GgmlType::q5_0 || F == GgmlType::q5_k) {
            for (int j = 0; j < 8; ++j) {
                uint64_t bits;
                std::memcpy(&bits, unit + 256 + 8 * j, 8);
                c[j] = _mm512_or_si512(c[j], _mm512_maskz_mov_epi8(static_cast<__mmask64>(bits), _mm512_set1_epi8(16)));
            }
        }
        if constexpr (F == GgmlType::q6_k) {
            // 128-bit lane s of step j takes bits 2s, 2s + 1 of the chunk's bytes
            const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
            const __m512i two = _mm512_set1_epi8(3);
            for (int j = 0; j < 8; ++j) {
                const __m512i chunk = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 256 + 16 * j)));
                const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(chunk, shift), two);
                c[j] = _mm512_or_si512(c[j], _mm512_slli_epi16(hi, 4));
            }
        }
    }
}

inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// The int32 dot products of steps [j0, j1) with x's weights at xp (two chains: vpdpbusd's latency).
inline __m512i dot_steps(const __m512i (&c)[8], const int8_t* xp, int j0, int j1) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int j = j0; j < j1; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, c[j], bcast4(xp + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, c[j + 1], bcast4(xp + 4 * j + 4));
    }
    return _mm512_add_epi32(s0, s1);
}

// out[m] (16 rows' float lanes) for activation rows m0 .. m0 + MT over the whole of K: units in order, each
// adding cvt(dot) * (S dx) + Mn ds; the order does not depend on MT.
template <GgmlType F, int MT>
inline void group_rows(const uint8_t* grp, const Layout& L, const Act& a, int64_t m0, __m512 (&out)[MT]) {
    for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
    const int64_t nrec = a.K / L.weights, U = a.K / 32;
    for (int64_t b = 0; b < nrec; ++b) {
        const uint8_t* rec = grp + b * L.record();
        const __m512 d = f16x16(rec);
        __m512 dmin = _mm512_setzero_ps();
        if constexpr (F == GgmlType::q4_1 || F == GgmlType::q4_k || F == GgmlType::q5_k) dmin = f16x16(rec + L.m_off);
        for (int64_t u = 0; u < L.units(); ++u) {
            const uint8_t* unit = rec + L.unit_off + u * L.unit_stride();
            __m512i c[8];
            unit_codes<F>(unit, c);
            const int64_t k0 = (b * L.units() + u) * 32;
            const int64_t ui = k0 / 32;
            if constexpr (F == GgmlType::q6_k) {
                const __m512 s0 = _mm512_mul_ps(d, i8x16(rec + L.sc_off + 16 * (2 * u)));
                const __m512 s1 = _mm512_mul_ps(d, i8x16(rec + L.sc_off + 16 * (2 * u + 1)));
                const __m512 n0 = _mm512_mul_ps(s0, _mm512_set1_ps(-32.f)), n1 = _mm512_mul_ps(s1, _mm512_set1_ps(-32.f));
                for (int m = 0; m < MT; ++m) {
                    const int64_t r = m0 + m;
                    const int8_t* xp = a.q + r * a.K + k0;
                    const __m512 dx = _mm512_set1_ps(a.dx[r * U + ui]);
                    const __m512i h0 = dot_steps(c, xp, 0, 4), h1 = dot_steps(c, xp, 4, 8);
                    out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0), _mm512_mul_ps(s0, dx), out[m]);
                    out[m] = _mm512_fmadd_ps(n0, _mm512_set1_ps(a.ds16[r * 2 * U + 2 * ui]), out[m]);
                    out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1), _mm512_mul_ps(s1, dx), out[m]);
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
                    const __m512i dot = dot_steps(c, a.q + r * a.K + k0, 0, 8);
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
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t m0 = mb; m0 < me; m0 += kMaxTile)
            group_tile<F, kMaxTile, T>(packed + g * group_bytes, L, a, m0, std::min<int64_t>(kMaxTile, me - m0),
                                       y + g * kGroupRows, ldy);
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
