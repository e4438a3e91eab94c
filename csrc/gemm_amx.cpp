// bf16 GEMM on AMX tiles with one reduction order for every row count (docs/native_kernels.md, "Batch
// invariance"): y [M, N] = x [M, K] @ w^T (+ bias), w given as its VNNI-packed copy [N/64, K/2, 64, 2]
// (fused_ops.pack_vnni), K % 32 == 0.
//
// Per 64-output chunk and block of 16 rows, four 16x16 float32 tiles accumulate over K in blocks of 32,
// always in the order k = 0, 32, 64, ...: tile C[j] += A[16 rows, 32 k] . B[32 k, 16 outputs of j].
// A row's result depends only on that row and the weights, never on how many rows share the call
// (rows past M in the last block are never stored), so a token gets the same bits decoded
// alone, in a batch of 64, or inside a prefill chunk.
//
//   B tile of chunk c, k-block q, outputs 16j..16j+15:   row p (k-pair 16q + p) = 16 (w[2p], w[2p+1]) pairs,
//   64 bytes at  wv + ((c * K/2 + 16q + p) * 64 + 16j) * 2,  so 16 rows 256 bytes apart.
#include "fused_ops.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace tokenmill {

// Linux gives a process the AMX tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); without that the first tile instruction faults.
bool os_allows_amx() {
#if defined(__linux__) && defined(__x86_64__)
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
#else
    return false;
#endif
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#endif

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 x 16 float32), 4: A (16 rows x 32 bf16), 5-6: B (16 k-pairs x 16 outputs x 2 bf16).
static void configure_tiles() {
    TileConfig cfg;
    for (int t = 0; t < 7; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

static bool gemm_amx_impl(const at::Tensor& y, const at::Tensor& x, const at::Tensor& wv,
                          const std::optional<at::Tensor>& bias) {
    const int64_t M = x.size(0), K = x.size(1), NC = wv.size(0), N = NC * 64, P = K / 2;
    if (M < 1 || K % 32 || wv.size(1) != P) return false;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(wv.data_ptr<at::BFloat16>());
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    const int64_t MB = (M + 15) / 16, tail = M - (MB - 1) * 16;
    // Small weights stay on the calling thread (a parallel region costs more than it saves there); the
    // split is over output chunks only, so it never changes a row's reduction order.
    const int64_t grain = N * K < (int64_t(1) << 17) ? NC : 1;
    at::parallel_for(0, NC, grain, [&](int64_t c0, int64_t c1) {
        configure_tiles();
        alignas(64) float out[16 * 64];
        // The last block's rows copied into 16 rows of K. The rows past `tail` hold zeros or an earlier
        // call's activations: a tile row only ever meets its own row of A, and those rows are never
        // stored, so they need no clearing (a decode step copies one row per linear, nothing more).
        thread_local std::vector<uint16_t> pad;
        if (tail < 16) {
            if (pad.size() < static_cast<size_t>(16 * K)) pad.assign(16 * K, 0);
            std::memcpy(pad.data(), xp + (MB - 1) * 16 * K, tail * K * sizeof(uint16_t));
        }
        for (int64_t c = c0; c < c1; ++c) {
            const uint16_t* wc = wp + c * P * 64 * 2;
            for (int64_t mb = 0; mb < MB; ++mb) {
                const bool last = mb == MB - 1 && tail < 16;
                const uint16_t* a = last ? pad.data() : xp + mb * 16 * K;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t q = 0; q < K / 32; ++q) {
                    const uint16_t* b = wc + q * 16 * 64 * 2;
                    _tile_loadd(4, a + q * 32, K * 2);
                    _tile_loadd(5, b, 256);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, b + 32, 256);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(5, b + 64, 256);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, b + 96, 256);
                    _tile_dpbf16ps(3, 4, 6);
                }
                _tile_stored(0, out, 256); _tile_stored(1, out + 16, 256);
                _tile_stored(2, out + 32, 256); _tile_stored(3, out + 48, 256);
                const int64_t rows = last ? tail : 16;
                for (int64_t r = 0; r < rows; ++r)
                    for (int j = 0; j < 4; ++j) {
                        __m512 v = _mm512_load_ps(out + r * 64 + 16 * j);
                        if (bp) v = _mm512_add_ps(v, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                                          (const __m256i*)(bp + c * 64 + 16 * j))));
                        _mm256_storeu_si256((__m256i*)(yp + (mb * 16 + r) * N + c * 64 + 16 * j),
                                            (__m256i)_mm512_cvtneps_pbh(v));
                    }
            }
        }
        _tile_release();
    });
    return true;
}

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

bool linear_bf16_amx(at::Tensor y, const at::Tensor& x, const at::Tensor& wv, const std::optional<at::Tensor>& bias) {
    return cpu_has_amx() && gemm_amx_impl(y, x, wv, bias);
}

}  // namespace tokenmill
