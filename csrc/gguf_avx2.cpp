// The GGUF integer kernel for AVX2 over packed row groups (gguf_layout.h). A 256-bit vector holds 4 weights of
// 8 rows, so each group runs as two halves of 8 rows. maddubs multiplies unsigned codes by signed activations
// into int16 pairs; two steps are added in int16 before widening, which cannot overflow for codes below 64
// (4 x 63 x 127 < 32768). Q8_0's signed bytes take the sign trick (|q| times x with q's sign), one step at a time.
#include "gguf_layout.h"
#include "gguf_quant.h"

#include "isa/avx2_begin.h"

namespace tokenmill::gguf {
namespace {

constexpr int kMaxTile = 4;   // activation rows per pass: 16 ymm registers hold their accumulators and sums

inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 32 bits -> 32 bytes, byte j = 0xFF where bit j is set. Worked example for bits = 0x00000105: byte j first
// holds byte j/8 of `bits` (0x05 for j < 8, 0x01 for 8 <= j < 16, 0 above), then keeps the bit j % 8 of it
// (mask 0x01, 0x02, 0x04, ... per position): bytes 0, 2 and 8 equal their mask -> 0xFF.
inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i mask = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
}

// Step j's codes for rows 8h .. 8h + 7 (unsigned; Q8_0 signed).
template <GgmlType F>
inline __m256i step_codes(const uint8_t* unit, int j, int h) {
    if constexpr (F == GgmlType::q8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64 * j + 32 * h));
    } else {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64 * (j % 4) + 32 * h));
        __m256i c = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
        if constexpr (F == GgmlType::q5_0 || F == GgmlType::q5_k) {
            uint32_t bits;
            std::memcpy(&bits, unit + 256 + 8 * j + 4 * h, 4);
            c = _mm256_or_si256(c, _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(16)));
        }
        if constexpr (F == GgmlType::q6_k) {
            // bytes 32h .. 32h + 31 of step j: 128-bit lane l takes bits 2 (2h + l), + 1 of the chunk's bytes
            const __m256i chunk = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 256 + 16 * j)));
            const __m256i shift = _mm256_setr_epi32(4 * h, 4 * h, 4 * h, 4 * h, 4 * h + 2, 4 * h + 2, 4 * h + 2, 4 * h + 2);
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(chunk, shift), _mm256_set1_epi8(3));
            c = _mm256_or_si256(c, _mm256_slli_epi16(hi, 4));
        }
        return c;
    }
}

inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// acc[m] += the int32 dot products of steps [j0, j1) for rows 8h .. 8h + 7 and activation rows m0 .. m0 + MT.
template <GgmlType F, int MT>
inline void dot_steps(const uint8_t* unit, int h, const Act& a, int64_t m0, int64_t k0, int j0, int j1, __m256i (&acc)[MT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = j0; j < j1; j += 2) {
        const __m256i c0 = step_codes<F>(unit, j, h), c1 = step_codes<F>(unit, j + 1, h);
        if constexpr (F == GgmlType::q8_0) {
            const __m256i a0 = _mm256_sign_epi8(c0, c0), a1 = _mm256_sign_epi8(c1, c1);
            for (int m = 0; m < MT; ++m) {
                const int8_t* xp = a.q + (m0 + m) * a.K + k0 + 4 * j;
                const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(bcast4(xp), c0));
                const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(bcast4(xp + 4), c1));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
            }
        } else {
            for (int m = 0; m < MT; ++m) {
                const int8_t* xp = a.q + (m0 + m) * a.K + k0 + 4 * j;
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4(xp)), _mm256_maddubs_epi16(c1, bcast4(xp + 4)));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
            }
        }
    }
}

// out[m] (rows 8h .. 8h + 7 of the group) for activation rows m0 .. m0 + MT over the whole of K: units in
// order, each adding cvt(dot) * (S dx) + Mn ds (Q6_K: per 16 weights); the order does not depend on MT.
template <GgmlType F, int MT>
inline void half_rows(const uint8_t* grp, int h, const Layout& L, const Act& a, int64_t m0, __m256 (&out)[MT]) {
    for (int m = 0; m < MT; ++m) out[m] = _mm256_setzero_ps();
    const int64_t nrec = a.K / L.weights, U = a.K / 32;
    for (int64_t b = 0; b < nrec; ++b) {
        const uint8_t* rec = grp + b * L.record();
        const __m256 d = f16x8(rec + 16 * h);
        __m256 dmin = _mm256_setzero_ps();
        if constexpr (F == GgmlType::q4_1 || F == GgmlType::q4_k || F == GgmlType::q5_k) dmin = f16x8(rec + L.m_off + 16 * h);
        for (int64_t u = 0; u < L.units(); ++u) {
            const uint8_t* unit = rec + L.unit_off + u * L.unit_stride();
            const int64_t ui = b * L.units() + u, k0 = 32 * ui;
            if constexpr (F == GgmlType::q6_k) {
                for (int half = 0; half < 2; ++half) {
                    const __m256 s = _mm256_mul_ps(d, i8x8(rec + L.sc_off + 16 * (2 * u + half) + 8 * h));
                    const __m256 mn = _mm256_mul_ps(s, _mm256_set1_ps(-32.f));
                    __m256i acc[MT];
                    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_si256();
                    dot_steps<F, MT>(unit, h, a, m0, k0, 4 * half, 4 * half + 4, acc);
                    for (int m = 0; m < MT; ++m) {
                        const int64_t r = m0 + m;
                        out[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(s, _mm256_set1_ps(a.dx[r * U + ui])), out[m]);
                        out[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.ds16[r * 2 * U + 2 * ui + half]), out[m]);
                    }
                }
            } else {
                __m256 s, mn;
                if constexpr (F == GgmlType::q4_k || F == GgmlType::q5_k) {
                    s = _mm256_mul_ps(d, u8x8(rec + L.sc_off + 16 * u + 8 * h));
                    mn = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, u8x8(rec + L.sc_off + 128 + 16 * u + 8 * h)));
                } else if constexpr (F == GgmlType::q4_1) {
                    s = d;
                    mn = dmin;
                } else {
                    constexpr float off = F == GgmlType::q4_0 ? -8.f : F == GgmlType::q5_0 ? -16.f : 0.f;   // Q8_0: signed
                    s = d;
                    mn = _mm256_mul_ps(d, _mm256_set1_ps(off));
                }
                __m256i acc[MT];
                for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_si256();
                dot_steps<F, MT>(unit, h, a, m0, k0, 0, 8, acc);
                for (int m = 0; m < MT; ++m) {
                    const int64_t r = m0 + m;
                    out[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(s, _mm256_set1_ps(a.dx[r * U + ui])), out[m]);
                    out[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.ds[r * U + ui]), out[m]);
                }
            }
        }
    }
}

template <typename T>
inline void store_rows(T* y, const __m256& v) {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    for (int i = 0; i < 8; ++i) y[i] = st<T>(f[i]);
}
template <>
inline void store_rows<float>(float* y, const __m256& v) { _mm256_storeu_ps(y, v); }

template <GgmlType F, int MT, typename T>
inline void half_tile(const uint8_t* grp, int h, const Layout& L, const Act& a, int64_t m0, int64_t t, T* y, int64_t ldy) {
    if constexpr (MT > 1) {
        if (t < MT) {
            half_tile<F, MT - 1, T>(grp, h, L, a, m0, t, y, ldy);
            return;
        }
    }
    __m256 out[MT];
    half_rows<F, MT>(grp, h, L, a, m0, out);
    for (int m = 0; m < MT; ++m) store_rows<T>(y + (m0 + m) * ldy + 8 * h, out[m]);
}

template <GgmlType F, typename T>
void run_groups(const uint8_t* packed, int64_t g0, int64_t g1, int64_t group_bytes, const Act& a, int64_t mb,
                int64_t me, T* y, int64_t ldy) {
    const Layout L = layout_of(static_cast<int64_t>(F));
    for (int64_t g = g0; g < g1; ++g)
        for (int h = 0; h < 2; ++h)
            for (int64_t m0 = mb; m0 < me; m0 += kMaxTile)
                half_tile<F, kMaxTile, T>(packed + g * group_bytes, h, L, a, m0, std::min<int64_t>(kMaxTile, me - m0),
                                          y + g * kGroupRows, ldy);
}

}  // namespace

template <typename T>
bool part_avx2(int64_t type, const uint8_t* packed, int64_t g0, int64_t g1, int64_t group_bytes, const Act& a,
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

template bool part_avx2<float>(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Act&, int64_t, int64_t,
                                float*, int64_t);
template bool part_avx2<at::BFloat16>(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Act&, int64_t,
                                       int64_t, at::BFloat16*, int64_t);

}  // namespace tokenmill::gguf

#include "isa/avx2_end.h"
