// AVX-512 helpers shared by the kernels. Include it inside namespace tokenmill, within an
// avx512_begin.h / avx512_end.h region (its functions take that region's target).
#pragma once

// exp(x) for 16 floats: Cephes-style range reduction and a degree-6 polynomial, relative error ~1e-7
// (std::exp's is ~1e-7 too); overflow gives +inf, x < -87 gives ~0.
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

// 16 elements of float32 or bfloat16 as 16 floats (bf16 -> float32 is exact).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Rounds 16 floats to T's precision and back: identity for float, round-to-nearest-even for bf16.
static inline __m512 round16(__m512 v, float*) { return v; }
static inline __m512 round16(__m512 v, at::BFloat16*) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                          _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Stores 16 floats that are already exact in T.
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(at::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
