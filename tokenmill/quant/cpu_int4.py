"""Weight-only int4 and int8 GEMVs for CPU decode: bf16 activations, AVX-512, int4 in our own layout.

(`int8_linear`, at the end: per-channel int8 rows converted exactly to float32 and FMA'd, up to 8
activation rows; it serves int8 checkpoints and the int8 LM head of int4 ones.)

Why: torch's `_weight_int4pack_mm_for_cpu` reads its packed weight at ~20 GB/s here, while the
bf16 GEMV of layers/fused_ops.py streams ~50 GB/s; an int4 step therefore gained only ~1.3x over
bf16 although it reads ~3.5x fewer bytes. The cost is not memory but turning nibbles into numbers
the FMA units take. This kernel does it in six instructions per 64 weights:

    w16 = zero-extend 32 bytes to 32 words     byte j of a 64-weight chunk = code[j] | code[j+32] << 4
    lo  = vpermw(table, w16)                  the index is the word's low 5 bits: low nibble + bit 4;
    hi  = vpermw(table, w16 >> 4)             table[i] = bf16((i & 15) - 8), exact
    acc = dpbf16(dpbf16(acc, lo, x[0:32]), hi, x[32:64])

and applies each group's scale once per group: y = sum_g s_g * sum_k (code_k - 8) x_k +
zero_g * sum_k x_k (tinygemm's affine form w = (code - 8) * s + zero). Products of bf16
values are exact in float32, sums are float32, so the result differs from the dequantize-then-
matmul reference only by the reference's rounding of w to bf16 and the order of the sums.

Layout "k64" (one row of bytes per output row, so a GEMV reads one sequential stream):
    qweight           [N, K/2] uint8   byte (n, 32c + j) = code[n, 64c + j] | code[n, 64c + 32 + j] << 4
    scales_and_zeros  [N, G, 2] bf16   (scale, zero) per row and group, row-major: with tinygemm's
                                       [G, N, 2] a row's G pairs lie N * 4 bytes apart, and the
                                       kernel ran ~25% slower on those scattered reads
Needs K % 64 == 0 and a group size that is a multiple of 64 (the default model's 64 is). It serves
any number of activation rows (blocks of up to 8 share each decoded weight chunk); for long
prompts the linear method's per-shape timing still picks dequantize-then-matmul where that wins.
A software prefetch 4 KB ahead of the weight stream gained 10-30% out of cache here (two A/B runs).
"""
from __future__ import annotations

import torch

from tokenmill.layers import cpp_ext

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#ifndef INT4_PREFETCH
#define INT4_PREFETCH 4096
#endif

// Sums of x over each group (float32), the zero-point term's factor: xs [M, G].
static void int4_group_sums(const uint16_t* xp, int64_t M, int64_t K, int64_t gs, float* xs) {
    const int64_t G = K / gs;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
            __m512 a = _mm512_setzero_ps();
            const uint16_t* p = xp + m * K + g * gs;
            for (int64_t k = 0; k < gs; k += 16) {
                __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + k)));
                a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
            xs[m * G + g] = _mm512_reduce_add_ps(a);
        }
}

// R output rows x M activation rows per pass; every decoded 64-weight chunk is used M times.
template <int R, int M>
static void int4_block(const uint8_t* qp, const at::BFloat16* sz, const uint16_t* xp, const float* xs,
                       const at::BFloat16* bp, at::BFloat16* yp, int64_t n, int64_t K, int64_t N,
                       int64_t gs, int64_t m0, const __m512i table) {
    const int64_t G = K / gs, chunks_per_group = gs / 64, half = K / 2;
    __m512 tot[R][M];
    float zterm[R][M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) { tot[r][m] = _mm512_setzero_ps(); zterm[r][m] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
        __m512 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
            for (int r = 0; r < R; ++r) {
                const uint8_t* wq = qp + (n + r) * half + c * 32;
                if ((c & 1) == 0) _mm_prefetch((const char*)(wq + INT4_PREFETCH), _MM_HINT_T0);
                const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)wq));
                const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(w16, table);
                const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w16, 4), table);
                for (int m = 0; m < M; ++m) {
                    const uint16_t* xr = xp + (m0 + m) * K + c * 64;
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], lo, (__m512bh)_mm512_loadu_si512(xr));
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], hi, (__m512bh)_mm512_loadu_si512(xr + 32));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float s = static_cast<float>(sz[((n + r) * G + g) * 2]);
            const float z = static_cast<float>(sz[((n + r) * G + g) * 2 + 1]);
            const __m512 sv = _mm512_set1_ps(s);
            for (int m = 0; m < M; ++m) {
                tot[r][m] = _mm512_fmadd_ps(acc[r][m], sv, tot[r][m]);
                zterm[r][m] += z * xs[(m0 + m) * G + g];
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const float b = bp ? static_cast<float>(bp[n + r]) : 0.f;
        for (int m = 0; m < M; ++m)
            yp[(m0 + m) * N + n + r] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(tot[r][m]) + zterm[r][m] + b);
    }
}

template <int M>
static void int4_rows(const uint8_t* qp, const at::BFloat16* sz, const uint16_t* xp, const float* xs,
                      const at::BFloat16* bp, at::BFloat16* yp, int64_t n0, int64_t n1, int64_t K, int64_t N,
                      int64_t gs, int64_t m0, const __m512i table) {
    constexpr int R = M == 1 ? 4 : M == 2 ? 4 : M <= 4 ? 2 : 1;
    int64_t n = n0;
    for (; n + R <= n1; n += R) int4_block<R, M>(qp, sz, xp, xs, bp, yp, n, K, N, gs, m0, table);
    for (; n < n1; ++n) int4_block<1, M>(qp, sz, xp, xs, bp, yp, n, K, N, gs, m0, table);
}

bool int4_linear(torch::Tensor y, torch::Tensor x, torch::Tensor qweight, torch::Tensor sz,
                 c10::optional<torch::Tensor> bias, int64_t gs) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (K % 64 || gs % 64 || K % gs || qweight.size(1) != K / 2 || sz.size(0) != N || sz.size(1) != K / gs) return false;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint8_t* qp = qweight.data_ptr<uint8_t>();
    const at::BFloat16* szp = sz.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    std::vector<float> xs(M * (K / gs));
    int4_group_sums(xp, M, K, gs, xs.data());
    alignas(64) uint16_t tbl[32];
    for (int i = 0; i < 32; ++i) {
        const float v = static_cast<float>((i & 15) - 8);
        uint32_t bits; std::memcpy(&bits, &v, 4); tbl[i] = static_cast<uint16_t>(bits >> 16);   // exact
    }
    const __m512i table = _mm512_load_si512(tbl);
    // Weight bytes are N * K / 2: stay on the calling thread below ~32 KB (a parallel region costs more).
    const int64_t grain = N * K < (int64_t(1) << 16) ? N : 32;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            switch (std::min<int64_t>(8, M - m0)) {
                case 1: int4_rows<1>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 2: int4_rows<2>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 3: int4_rows<3>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 4: int4_rows<4>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 5: int4_rows<5>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 6: int4_rows<6>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                case 7: int4_rows<7>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
                default: int4_rows<8>(qp, szp, xp, xs.data(), bp, yp, n0, n1, K, N, gs, m0, table); break;
            }
        }
    });
    return true;
}

// Weight-only int8 GEMV for a few rows (decode; the int8 LM head of int4 checkpoints): y [M, N] =
// x [M, K] @ (q [N, K] * scale[N] + offset[N])^T, x bf16, float32 math with exact int8 -> float
// conversion (no activation quantization). ~3 ops per 16 weights keeps it at the memory bound;
// torch's _weight_int8pack_mm read ~32 GB/s here against ~70 for a plain stream.
bool int8_linear(torch::Tensor y, torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 c10::optional<torch::Tensor> offsets) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (K % 64 || M > 8 || qweight.size(1) != K || scales.numel() != N) return false;
    const uint16_t* xp16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const int8_t* qp = qweight.data_ptr<int8_t>();
    const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
    const at::BFloat16* op = offsets.has_value() ? offsets->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    std::vector<float> xf(M * K), xsum(M, 0.f);
    for (int64_t i = 0; i < M * K; ++i) {
        uint32_t b = static_cast<uint32_t>(xp16[i]) << 16; std::memcpy(&xf[i], &b, 4);
        xsum[i / K] += xf[i];
    }
    const float* xp = xf.data();
    const int64_t grain = N * K < (int64_t(1) << 17) ? N : 64;
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        if (M == 1) {  // one row: four independent FMA chains (two were latency-bound)
            for (int64_t n = n0; n < n1; ++n) {
                const int8_t* w = qp + n * K;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t k = 0; k < K; k += 64) {
                    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k)))),
                                         _mm512_loadu_ps(xp + k), a0);
                    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 16)))),
                                         _mm512_loadu_ps(xp + k + 16), a1);
                    a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 32)))),
                                         _mm512_loadu_ps(xp + k + 32), a2);
                    a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 48)))),
                                         _mm512_loadu_ps(xp + k + 48), a3);
                }
                const float sc = static_cast<float>(sp[n]), of = op ? static_cast<float>(op[n]) : 0.f;
                yp[n] = static_cast<at::BFloat16>(
                    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) * sc + of * xsum[0]);
            }
            return;
        }
        for (int64_t n = n0; n < n1; ++n) {
            const int8_t* w = qp + n * K;
            __m512 acc[8][2];
            for (int64_t m = 0; m < M; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
            for (int64_t k = 0; k < K; k += 32) {
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k))));
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 16))));
                for (int64_t m = 0; m < M; ++m) {
                    acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + m * K + k), acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + m * K + k + 16), acc[m][1]);
                }
            }
            const float sc = static_cast<float>(sp[n]), of = op ? static_cast<float>(op[n]) : 0.f;
            for (int64_t m = 0; m < M; ++m)
                yp[m * N + n] = static_cast<at::BFloat16>(
                    _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) * sc + of * xsum[m]);
        }
    });
    return true;
}
#else
bool int4_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t) {
    return false;
}
bool int8_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
    return false;
}
#endif

bool int4_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return true;
#else
    return false;
#endif
}
"""

DECLS = """
bool int4_linear(torch::Tensor y, torch::Tensor x, torch::Tensor qweight, torch::Tensor sz,
                 c10::optional<torch::Tensor> bias, int64_t gs);
bool int4_supported();
bool int8_linear(torch::Tensor y, torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 c10::optional<torch::Tensor> offsets);
"""

_NAME = "tokenmill_int4_gemv_v5"


def _ext():
    return cpp_ext.load(_NAME, DECLS, SOURCE, ["int4_linear", "int4_supported", "int8_linear"])


def available() -> bool:
    """The kernel was built and this CPU has AVX512-BF16."""
    ext = _ext()
    return ext is not None and bool(ext.int4_supported())


def layout_ok(in_features: int, group_size: int) -> bool:
    return in_features % 64 == 0 and group_size % 64 == 0 and in_features % group_size == 0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> qweight [N, K/2] uint8 in the k64 layout (module docstring)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 64, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: [N, K/2] uint8 -> [N, K] codes (uint8)."""
    n, half = packed.shape
    b = packed.reshape(n, half // 32, 1, 32)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, half * 2)


def linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] bf16 @ dequant(qweight)^T (+ bias) -> [M, N] bf16, or None when the kernel cannot serve it."""
    if (x.dtype != torch.bfloat16 or scales_and_zeros.dtype != torch.bfloat16 or x.dim() != 2
            or x.device.type != "cpu" or (bias is not None and bias.dtype != torch.bfloat16)):
        return None
    return _run("int4_linear", x, qweight.shape[0], qweight, scales_and_zeros, bias, group_size)


def _run(kernel: str, x: torch.Tensor, n_out: int, *args) -> torch.Tensor | None:
    """y [M, n_out] = ext.<kernel>(y, x, *args), or None when the extension is missing or refuses."""
    ext = _ext()
    if ext is None:
        return None
    x = x.contiguous()
    y = x.new_empty(x.shape[0], n_out)
    return y if getattr(ext, kernel)(y, x, *args) else None


INT8_MAX_ROWS = 8


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                offsets: torch.Tensor | None) -> torch.Tensor | None:
    """Per-channel int8 weight-only linear for up to 8 bf16 rows: x @ (qweight * scales + offsets)^T,
    or None when the kernel cannot serve the call (the caller then uses torch's int8 kernel)."""
    if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] > INT8_MAX_ROWS or x.device.type != "cpu"
            or scales.dtype != torch.bfloat16 or (offsets is not None and offsets.dtype != torch.bfloat16)):
        return None
    return _run("int8_linear", x, qweight.shape[0], qweight, scales.reshape(-1).contiguous(),
                None if offsets is None else offsets.reshape(-1).contiguous())
