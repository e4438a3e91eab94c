// GGUF blocks repacked into row groups (gguf_layout.h): the packer, a scalar dequantizer (embedding rows; the
// reference path below AVX2), the activations' quantizer and the dispatch to the kernel of this CPU
// (gguf_avx2.cpp, gguf_vnni.cpp).
#include "gguf_quant.h"

#include <atomic>

#include <c10/util/Half.h>

#include "gguf_layout.h"

namespace tokenmill {

using gguf::Layout;
using gguf::kGroupRows;

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

namespace gguf {
Layout layout_of(int64_t type) {
    //                          weights  unit_off  code  hi  m_off  sc_off
    switch (static_cast<GgmlType>(type)) {
        case GgmlType::q4_0: return {32, 32, 256, 0, -1, -1};
        case GgmlType::q4_1: return {32, 64, 256, 0, 32, -1};
        case GgmlType::q5_0: return {32, 32, 256, 1, -1, -1};
        case GgmlType::q8_0: return {32, 32, 512, 0, -1, -1};
        case GgmlType::q4_k: return {256, 320, 256, 0, 32, 64};
        case GgmlType::q5_k: return {256, 320, 256, 1, 32, 64};
        case GgmlType::q6_k: return {256, 288, 256, 2, -1, 32};
    }
    TORCH_CHECK(false, "gguf: ggml type ", type, " is not served");
}
}  // namespace gguf

int64_t gguf_record_bytes(int64_t type) { return gguf::layout_of(type).record(); }

// ------------------------------------------------------------------------------- the file's blocks

static float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

static void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
    if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
    else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30); mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30); }
}

// One file block's codes, in weight order: unsigned (w = S c + Mn), or Q8_0's signed bytes.
static void block_codes(GgmlType type, const uint8_t* b, uint8_t* c) {
    switch (type) {
        case GgmlType::q4_0: case GgmlType::q4_1: case GgmlType::q5_0: {
            const uint8_t* qs = b + (type == GgmlType::q4_0 ? 2 : type == GgmlType::q4_1 ? 4 : 6);
            uint32_t qh = 0;
            if (type == GgmlType::q5_0) std::memcpy(&qh, b + 2, 4);
            for (int j = 0; j < 16; ++j) {
                c[j] = static_cast<uint8_t>((qs[j] & 15) | (((qh >> j) & 1) << 4));
                c[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
            }
            return;
        }
        case GgmlType::q8_0:
            std::memcpy(c, b + 2, 32);
            return;
        case GgmlType::q4_k: case GgmlType::q5_k: {
            const bool five = type == GgmlType::q5_k;
            const uint8_t* qh = b + 16;
            const uint8_t* qs = b + (five ? 48 : 16);
            for (int u = 0; u < 8; ++u)
                for (int l = 0; l < 32; ++l) {
                    int q = (qs[32 * (u / 2) + l] >> (4 * (u % 2))) & 15;
                    if (five) q |= ((qh[l] >> u) & 1) << 4;
                    c[32 * u + l] = static_cast<uint8_t>(q);
                }
            return;
        }
        case GgmlType::q6_k:
            for (int u = 0; u < 8; ++u) {
                const int h = u / 4, t = u % 4;
                const uint8_t* ql = b + 64 * h + 32 * (t % 2);
                const uint8_t* qh = b + 128 + 32 * h;
                for (int l = 0; l < 32; ++l)
                    c[32 * u + l] = static_cast<uint8_t>(((ql[l] >> (4 * (t / 2))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4));
            }
            return;
    }
}

// ------------------------------------------------------------------------------- the packed records

// Byte p of a unit's unpacked codes (gguf_layout.h's worked example) for row r, weight k.
static inline int64_t code_pos(int64_t r, int64_t k) { return 64 * (k / 4) + 4 * r + k % 4; }

static void put_code(const Layout& L, uint8_t* unit, int64_t r, int64_t k, uint8_t c) {
    const int64_t p = code_pos(r, k);
    if (L.code_bytes == 512) {
        unit[p] = c;
        return;
    }
    unit[p % 256] = static_cast<uint8_t>(p < 256 ? (unit[p % 256] & 0xF0) | (c & 15) : (unit[p % 256] & 15) | ((c & 15) << 4));
    uint8_t* hi = unit + 256;
    if (L.hi_bits == 1 && (c & 16)) hi[p / 8] = static_cast<uint8_t>(hi[p / 8] | (1 << (p % 8)));
    if (L.hi_bits == 2) hi[16 * (p / 64) + p % 16] = static_cast<uint8_t>(hi[16 * (p / 64) + p % 16] | (((c >> 4) & 3) << (2 * ((p % 64) / 16))));
}

static int get_code(const Layout& L, const uint8_t* unit, int64_t r, int64_t k) {
    const int64_t p = code_pos(r, k);
    if (L.code_bytes == 512) return unit[p];
    int c = (unit[p % 256] >> (p < 256 ? 0 : 4)) & 15;
    const uint8_t* hi = unit + 256;
    if (L.hi_bits == 1) c |= ((hi[p / 8] >> (p % 8)) & 1) << 4;
    if (L.hi_bits == 2) c |= ((hi[16 * (p / 64) + p % 16] >> (2 * ((p % 64) / 16))) & 3) << 4;
    return c;
}

// Row r's file block b -> its place in record `rec`.
static void pack_block(GgmlType type, const Layout& L, const uint8_t* b, uint8_t* rec, int64_t r) {
    uint8_t codes[256];
    block_codes(type, b, codes);
    for (int64_t k = 0; k < L.weights; ++k) put_code(L, rec + L.unit_off + (k / 32) * L.unit_stride(), r, k % 32, codes[k]);
    switch (type) {
        case GgmlType::q4_0: case GgmlType::q5_0: case GgmlType::q8_0:
            std::memcpy(rec + 2 * r, b, 2);
            return;
        case GgmlType::q4_1: case GgmlType::q4_k: case GgmlType::q5_k:
            std::memcpy(rec + 2 * r, b, 2);
            std::memcpy(rec + L.m_off + 2 * r, b + 2, 2);
            if (L.sc_off >= 0)
                for (int u = 0; u < 8; ++u) {
                    int sc, mn;
                    scale_min_k4(b + 4, u, sc, mn);
                    rec[L.sc_off + 16 * u + r] = static_cast<uint8_t>(sc);
                    rec[L.sc_off + 128 + 16 * u + r] = static_cast<uint8_t>(mn);
                }
            return;
        case GgmlType::q6_k:
            std::memcpy(rec + 2 * r, b + 208, 2);
            for (int s = 0; s < 16; ++s) rec[L.sc_off + 16 * s + r] = b[192 + s];
            return;
    }
}

at::Tensor gguf_pack(const at::Tensor& blocks, int64_t type) {
    TORCH_CHECK(gguf_type_served(type), "gguf_pack: ggml type ", type, " is not served");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous()
                    && blocks.size(0) % kGroupRows == 0 && blocks.size(1) % gguf_block_bytes(type) == 0,
                "gguf_pack: blocks must be contiguous uint8 [N, row bytes], N a multiple of 16, whole blocks per row");
    const Layout L = gguf::layout_of(type);
    const int64_t N = blocks.size(0), nb = blocks.size(1) / gguf_block_bytes(type), bb = gguf_block_bytes(type);
    at::Tensor out = at::zeros({N / kGroupRows, nb * L.record()}, blocks.options());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const auto t = static_cast<GgmlType>(type);
    at::parallel_for(0, N / kGroupRows, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t blk = 0; blk < nb; ++blk)
                for (int64_t r = 0; r < kGroupRows; ++r)
                    pack_block(t, L, src + (g * kGroupRows + r) * blocks.size(1) + blk * bb,
                               dst + g * out.size(1) + blk * L.record(), r);
    });
    return out;
}

// Row r of record `rec` -> its block's weights in float32, as ggml's reference dequantizers compute them.
static void dequant_record_row(GgmlType type, const Layout& L, const uint8_t* rec, int64_t r, float* w) {
    const float d = f16(rec + 2 * r);
    for (int64_t k = 0; k < L.weights; ++k) {
        const int64_t u = k / 32;
        const int c = get_code(L, rec + L.unit_off + u * L.unit_stride(), r, k % 32);
        switch (type) {
            case GgmlType::q4_0: w[k] = d * (c - 8); break;
            case GgmlType::q4_1: w[k] = d * c + f16(rec + L.m_off + 2 * r); break;
            case GgmlType::q5_0: w[k] = d * (c - 16); break;
            case GgmlType::q8_0: w[k] = d * static_cast<int8_t>(c); break;
            case GgmlType::q4_k: case GgmlType::q5_k: {
                const float s = d * rec[L.sc_off + 16 * u + r], m = f16(rec + L.m_off + 2 * r) * rec[L.sc_off + 128 + 16 * u + r];
                w[k] = s * c - m;
                break;
            }
            case GgmlType::q6_k:
                w[k] = d * static_cast<int8_t>(rec[L.sc_off + 16 * (k / 16) + r]) * (c - 32);
                break;
        }
    }
}

void gguf_dequantize_rows(at::Tensor out, const at::Tensor& packed, int64_t type, const at::Tensor& rows) {
    TORCH_CHECK(gguf_type_served(type), "gguf_dequantize_rows: ggml type ", type, " is not served");
    TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
                "gguf_dequantize_rows: packed must be contiguous uint8 [N / 16, group bytes]");
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && rows.dim() == 1 && rows.scalar_type() == at::kLong
                    && out.size(0) == rows.size(0),
                "gguf_dequantize_rows: out [R, K] contiguous and rows [R] int64");
    const Layout L = gguf::layout_of(type);
    const int64_t K = out.size(1), bw = L.weights;
    TORCH_CHECK(K % bw == 0 && packed.size(1) == K / bw * L.record(), "gguf_dequantize_rows: ", K,
                " columns do not match groups of ", packed.size(1), " bytes");
    const int64_t N = packed.size(0) * kGroupRows;
    const int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.size(0); ++i)
        TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "gguf_dequantize_rows: row ", rp[i], " out of range [0, ", N, ")");
    const uint8_t* bp = packed.data_ptr<uint8_t>();
    const auto t = static_cast<GgmlType>(type);
    TOKENMILL_DISPATCH_FLOAT(out, "gguf_dequantize_rows", {
        T* op = out.data_ptr<T>();
        for_rows(rows.size(0), K, [&](int64_t i) {
            std::vector<float> w(bw);
            const uint8_t* grp = bp + (rp[i] / kGroupRows) * packed.size(1);
            for (int64_t blk = 0; blk < K / bw; ++blk) {
                dequant_record_row(t, L, grp + blk * L.record(), rp[i] % kGroupRows, w.data());
                for (int64_t j = 0; j < bw; ++j) op[i * K + blk * bw + j] = st<T>(w[j]);
            }
        });
    });
}

// ------------------------------------------------------------------------------- activations

#include "isa/avx2_begin.h"
#include "vec_avx2.h"

// x [M, K] -> int8 codes per 32 (scale max|x| / 127, round to nearest even), the scales, and the scales times
// the sum of each unit's and each half's codes (gguf_layout.h, Act). Shared by both kernels (every AVX-512 CPU
// has AVX2).
template <typename T>
static void quantize_activations(const T* x, int64_t M, int64_t K, int8_t* q, float* dx, float* ds, float* ds16) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const int64_t U = K / 32;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t u = 0; u < U; ++u) {
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
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * K + u * 32), codes);
            // maddubs multiplies unsigned by signed bytes: ones times the codes; lane i sums codes 4i .. 4i + 3
            alignas(32) int32_t s4[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(s4), _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16));
            const int32_t lo = s4[0] + s4[1] + s4[2] + s4[3], hi = s4[4] + s4[5] + s4[6] + s4[7];
            dx[r * U + u] = dd;
            ds[r * U + u] = dd * static_cast<float>(lo + hi);
            ds16[r * 2 * U + 2 * u] = dd * static_cast<float>(lo);
            ds16[r * 2 * U + 2 * u + 1] = dd * static_cast<float>(hi);
        }
    }
}

#include "isa/avx2_end.h"

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
        const Layout L = gguf::layout_of(types[i]);
        TORCH_CHECK(parts[i].dim() == 2 && parts[i].scalar_type() == at::kByte && parts[i].is_contiguous()
                        && K % L.weights == 0 && parts[i].size(1) == K / L.weights * L.record(),
                    "gguf_linear: part ", i, " is not contiguous packed groups of K = ", K, " weights per row");
        n_total += parts[i].size(0) * kGroupRows;
    }
    TORCH_CHECK(y.size(1) == n_total, "gguf_linear: y has ", y.size(1), " columns, the parts ", n_total);
    const bool vnni = cpu_has_avx512_vnni();
    if (!vnni && !cpu_has_avx2()) return false;
    if (M == 0) return true;
    std::vector<int8_t> q(M * K);
    std::vector<float> dx(M * (K / 32)), ds(M * (K / 32)), ds16(M * (K / 16));
    const gguf::Act a{q.data(), dx.data(), ds.data(), ds16.data(), K};
    bool ok = false;
    TOKENMILL_DISPATCH_FLOAT(x, "gguf_linear", {
        quantize_activations<T>(x.data_ptr<T>(), M, K, q.data(), dx.data(), ds.data(), ds16.data());
        T* yp = y.data_ptr<T>();
        // Every part's groups in one index space: part i holds [first[i], first[i + 1]) and fills the columns from
        // 16 first[i]. One parallel region per block of activation rows serves all parts.
        std::vector<int64_t> first(parts.size() + 1, 0);
        int64_t bytes = 0;
        for (size_t i = 0; i < parts.size(); ++i) {
            first[i + 1] = first[i] + parts[i].size(0);
            bytes += parts[i].numel();
        }
        constexpr int64_t kRowBlock = 64;   // activation rows whose codes stay in L2 while the groups pass
        std::atomic<bool> served{true};
        for (int64_t mb = 0; mb < M; mb += kRowBlock) {
            const int64_t me = std::min(M, mb + kRowBlock);
            // a small call (a few groups, one row) runs on this thread: waking the pool costs more
            const int64_t grain = bytes * (me - mb) < (int64_t(1) << 15) ? first.back() : 1;
            at::parallel_for(0, first.back(), grain, [&](int64_t lo, int64_t hi) {
                for (size_t i = 0; i < parts.size(); ++i) {
                    const int64_t g0 = std::max(lo, first[i]) - first[i], g1 = std::min(hi, first[i + 1]) - first[i];
                    if (g0 >= g1) continue;
                    const uint8_t* p = parts[i].data_ptr<uint8_t>();
                    const int64_t gb = parts[i].size(1);
                    T* yc = yp + first[i] * kGroupRows;
                    const bool done = vnni ? gguf::part_vnni<T>(types[i], p, g0, g1, gb, a, mb, me, yc, y.stride(0))
                                           : gguf::part_avx2<T>(types[i], p, g0, g1, gb, a, mb, me, yc, y.stride(0));
                    if (!done) served = false;
                }
            });
        }
        ok = served;
    });
    return ok;
}

}  // namespace tokenmill
