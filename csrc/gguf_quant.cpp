// GGUF blocks as they lie in the file (gguf_quant.h): an integer kernel per instruction set (gguf_kernel.inc)
// and a scalar dequantizer (embedding rows; the reference path below AVX2).
#include "gguf_quant.h"

#include <c10/util/Half.h>

namespace tokenmill {

bool gguf_type_served(int64_t type) {
    switch (static_cast<GgmlType>(type)) {
        case GgmlType::q4_0: case GgmlType::q4_1: case GgmlType::q5_0: case GgmlType::q8_0:
        case GgmlType::q4_k: case GgmlType::q5_k: case GgmlType::q6_k:
            return true;
    }
    return false;
}

int64_t gguf_block_weights(int64_t type) {
    const auto t = static_cast<GgmlType>(type);
    return t == GgmlType::q4_k || t == GgmlType::q5_k || t == GgmlType::q6_k ? 256 : 32;
}

int64_t gguf_block_bytes(int64_t type) {
    switch (static_cast<GgmlType>(type)) {
        case GgmlType::q4_0: return 18;
        case GgmlType::q4_1: return 20;
        case GgmlType::q5_0: return 22;
        case GgmlType::q8_0: return 34;
        case GgmlType::q4_k: return 144;
        case GgmlType::q5_k: return 176;
        case GgmlType::q6_k: return 210;
    }
    TORCH_CHECK(false, "gguf: ggml type ", type, " is not served");
}

// ------------------------------------------------------------------------------- scalar dequantization

static float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

static void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
    if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
    else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30); mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30); }
}

// One block -> its weights in float32, as ggml's reference dequantizers compute them.
static void dequant_block(GgmlType type, const uint8_t* b, float* w) {
    switch (type) {
        case GgmlType::q4_0: {
            const float d = f16(b);
            for (int j = 0; j < 16; ++j) { w[j] = d * ((b[2 + j] & 15) - 8); w[j + 16] = d * ((b[2 + j] >> 4) - 8); }
            return;
        }
        case GgmlType::q4_1: {
            const float d = f16(b), m = f16(b + 2);
            for (int j = 0; j < 16; ++j) { w[j] = d * (b[4 + j] & 15) + m; w[j + 16] = d * (b[4 + j] >> 4) + m; }
            return;
        }
        case GgmlType::q5_0: {
            const float d = f16(b);
            uint32_t qh;
            std::memcpy(&qh, b + 2, 4);
            for (int j = 0; j < 16; ++j) {
                const int lo = (b[6 + j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
                const int hi = (b[6 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
                w[j] = d * (lo - 16);
                w[j + 16] = d * (hi - 16);
            }
            return;
        }
        case GgmlType::q8_0: {
            const float d = f16(b);
            for (int j = 0; j < 32; ++j) w[j] = d * static_cast<int8_t>(b[2 + j]);
            return;
        }
        case GgmlType::q4_k:
        case GgmlType::q5_k: {
            const bool five = type == GgmlType::q5_k;
            const float d = f16(b), dmin = f16(b + 2);
            const uint8_t* qh = b + 16;
            const uint8_t* qs = b + (five ? 48 : 16);
            for (int u = 0; u < 8; ++u) {
                int sc, mn;
                scale_min_k4(b + 4, u, sc, mn);
                const float s = d * sc, m = dmin * mn;
                for (int l = 0; l < 32; ++l) {
                    int q = (qs[32 * (u / 2) + l] >> (4 * (u % 2))) & 15;
                    if (five) q |= ((qh[l] >> u) & 1) << 4;
                    w[32 * u + l] = s * q - m;
                }
            }
            return;
        }
        case GgmlType::q6_k: {
            const float d = f16(b + 208);
            const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
            for (int u = 0; u < 8; ++u) {
                const int h = u / 4, t = u % 4;
                const uint8_t* ql = b + 64 * h + 32 * (t % 2);
                const uint8_t* qh = b + 128 + 32 * h;
                for (int l = 0; l < 32; ++l) {
                    const int q = ((ql[l] >> (4 * (t / 2))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
                    w[32 * u + l] = d * sc[2 * u + l / 16] * (q - 32);
                }
            }
            return;
        }
    }
    TORCH_CHECK(false, "gguf: ggml type ", static_cast<int64_t>(type), " is not served");
}

void gguf_dequantize_rows(at::Tensor out, const at::Tensor& blocks, int64_t type, const at::Tensor& rows) {
    TORCH_CHECK(gguf_type_served(type), "gguf_dequantize_rows: ggml type ", type, " is not served");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
                "gguf_dequantize_rows: blocks must be contiguous uint8 [N, row bytes]");
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && rows.dim() == 1 && rows.scalar_type() == at::kLong
                    && out.size(0) == rows.size(0),
                "gguf_dequantize_rows: out [R, K] contiguous and rows [R] int64");
    const int64_t K = out.size(1), bw = gguf_block_weights(type), bb = gguf_block_bytes(type);
    TORCH_CHECK(K % bw == 0 && blocks.size(1) == K / bw * bb, "gguf_dequantize_rows: ", K,
                " columns do not match blocks of ", blocks.size(1), " bytes per row");
    const int64_t N = blocks.size(0);
    const int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.size(0); ++i)
        TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "gguf_dequantize_rows: row ", rp[i], " out of range [0, ", N, ")");
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    const auto t = static_cast<GgmlType>(type);
    TOKENMILL_DISPATCH_FLOAT(out, "gguf_dequantize_rows", {
        T* op = out.data_ptr<T>();
        for_rows(rows.size(0), K, [&](int64_t i) {
            std::vector<float> w(bw);
            const uint8_t* row = bp + rp[i] * blocks.size(1);
            for (int64_t blk = 0; blk < K / bw; ++blk) {
                dequant_block(t, row + blk * bb, w.data());
                for (int64_t j = 0; j < bw; ++j) op[i * K + blk * bw + j] = st<T>(w[j]);
            }
        });
    });
}

// ------------------------------------------------------------------------------- integer kernels

#include "isa/avx2_begin.h"
#include "vec_avx2.h"

// x [M, K] -> int8 codes per 32 (scale max|x| / 127, round to nearest even), the scales, each 4 codes' sum
// times its scale, and the scales once per 4 codes (gguf_kernel.inc, Act: rows padded by one zero unit).
// Shared by both kernels (every AVX-512 CPU has AVX2).
template <typename T>
static void quantize_activations(const T* x, int64_t M, int64_t K, int8_t* q, float* d, float* s4, float* d8) {
    const int64_t xs = K + 32, ls = K / 4 + 8;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t u = 0; u < K / 32; ++u) {
            const T* p = x + r * K + u * 32;
            __m256 v[4] = {load8(p), load8(p + 8), load8(p + 16), load8(p + 24)};
            __m256 amax = _mm256_andnot_ps(sign, v[0]);
            for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            const float mx = hmax8(amax);
            const float dd = mx / 127.f;
            const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
            __m256i iv[4];
            for (int i = 0; i < 4; ++i)
                iv[i] = _mm256_cvtps_epi32(
                    _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            // packs work within 128-bit lanes; the permute puts the 32 codes back in order
            const __m256i w16a = _mm256_packs_epi32(iv[0], iv[1]), w16b = _mm256_packs_epi32(iv[2], iv[3]);
            const __m256i codes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * xs + u * 32), codes);
            d[r * (K / 32) + u] = dd;
            // maddubs multiplies unsigned by signed bytes: ones times the codes
            const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16);
            _mm256_storeu_ps(s4 + r * ls + u * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(dd)));
            _mm256_storeu_ps(d8 + r * ls + u * 8, _mm256_set1_ps(dd));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * xs + K), _mm256_setzero_si256());
        _mm256_storeu_ps(s4 + r * ls + K / 4, _mm256_setzero_ps());
        _mm256_storeu_ps(d8 + r * ls + K / 4, _mm256_setzero_ps());
    }
}

namespace gguf_avx2 {
constexpr int64_t kMaxTile = 4;   // 16 ymm registers: 4 accumulators and the unit's operands
static inline __m256i dot4(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));   // pairs of products fit int16
}
#include "gguf_kernel.inc"
}  // namespace gguf_avx2
#include "isa/avx2_end.h"

#include "isa/avx512_vnni_begin.h"
#define TOKENMILL_GGUF_WIDE
namespace gguf_vnni {
constexpr int64_t kMaxTile = 8;   // 32 zmm registers: a (dot, minimum) accumulator pair per row
static inline __m256i dot4(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#include "gguf_kernel.inc"
}  // namespace gguf_vnni
#undef TOKENMILL_GGUF_WIDE
#include "isa/avx512_end.h"

const char* gguf_kernel_name() {
    if (cpu_has_avx512_vnni()) return "avx512_vnni";
    if (cpu_has_avx2()) return "avx2";
    return "none";
}

bool gguf_linear(at::Tensor y, const at::Tensor& x, const std::vector<at::Tensor>& parts,
                 const std::vector<int64_t>& types) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gguf_linear: x must be a contiguous [M, K] tensor");
    TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "gguf_linear: one type per part");
    TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.scalar_type() == x.scalar_type(),
                "gguf_linear: y must be [M, N] with unit column stride and x's dtype");
    const int64_t M = x.size(0), K = x.size(1);
    int64_t n_total = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        TORCH_CHECK(gguf_type_served(types[i]), "gguf_linear: ggml type ", types[i], " is not served");
        const int64_t bw = gguf_block_weights(types[i]);
        TORCH_CHECK(parts[i].dim() == 2 && parts[i].scalar_type() == at::kByte && parts[i].is_contiguous()
                        && K % bw == 0 && parts[i].size(1) == K / bw * gguf_block_bytes(types[i]),
                    "gguf_linear: part ", i, " is not contiguous uint8 blocks of K = ", K, " weights per row");
        n_total += parts[i].size(0);
    }
    TORCH_CHECK(y.size(1) == n_total, "gguf_linear: y has ", y.size(1), " columns, the parts ", n_total);
    const bool vnni = cpu_has_avx512_vnni();
    if (!vnni && !cpu_has_avx2()) return false;
    if (M == 0) return true;
    std::vector<int8_t> q(M * (K + 32));
    std::vector<float> d(M * (K / 32)), s4(M * (K / 4 + 8)), d8(M * (K / 4 + 8));
    const gguf_avx2::Act a{q.data(), d.data(), s4.data(), d8.data(), K};
    bool ok = false;
    TOKENMILL_DISPATCH_FLOAT(x, "gguf_linear", {
        quantize_activations<T>(x.data_ptr<T>(), M, K, q.data(), d.data(), s4.data(), d8.data());
        T* yp = y.data_ptr<T>();
        if (vnni) {
            const gguf_vnni::Act av{a.q, a.d, a.s4, a.d8, K};
            ok = gguf_vnni::run_parts<T>(yp, y.stride(0), av, M, parts, types);
        } else {
            ok = gguf_avx2::run_parts<T>(yp, y.stride(0), a, M, parts, types);
        }
    });
    return ok;
}

}  // namespace tokenmill
