// AVX2 helpers shared by the kernels, the 8-lane twins of vec_avx512.h. Include it inside namespace
// tokenmill, within an avx2_begin.h / avx2_end.h region (its functions take that region's target).
#pragma once

// exp(x) for 8 floats, exp16's algorithm: Cephes-style range reduction and a degree-6 polynomial,
// relative error ~1e-7; overflow gives +inf, x < -87 gives ~0. AVX2 has no scalef: 2^n is built in the
// exponent field, as two factors 2^(n/2) * 2^(n - n/2) so that n = 128 (overflow) and n = -126 stay in range.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(89.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

// 8 elements of float32 or bfloat16 as 8 floats (bf16 -> float32 is exact).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 16 consecutive bf16 as two vectors of 8 floats, without a lane-crossing unpack: `even` holds elements
// 0, 2, ..., 14 and `odd` elements 1, 3, ..., 15 (each 32-bit lane holds one pair; the low half is the
// even element). Kernels whose other operand is stored in the same split order use this.
static inline __m256 bf16_even8(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
static inline __m256 bf16_odd8(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 8 floats -> their bf16 bit patterns in the low 16 bits of each lane, round to nearest even, NaN -> quiet NaN
// (c10::BFloat16's rule, so a vector result equals static_cast<at::BFloat16> of each lane).
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                          _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// Rounds 8 floats to T's precision and back: identity for float, bf16's rounding for bf16.
static inline __m256 round8(__m256 v, float*) { return v; }
static inline __m256 round8(__m256 v, at::BFloat16*) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

// Stores 8 floats as T: float as is, bf16 rounded (round8 then store8 rounds once: exact values stay).
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(at::BFloat16* p, __m256 v) {
    const __m256i b = bf16_bits8(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// The sum of 8 lanes, always in the same order: (lane i + lane i+4), then pairs, then the last two.
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The maximum of 8 lanes.
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
