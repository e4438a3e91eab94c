// The layout GGUF blocks are repacked into at load (gguf_quant.cpp packs, gguf_avx2.cpp and gguf_vnni.cpp
// read it), and the quantized activations both kernels take. Internal to the GGUF files.
//
// Weight rows are taken 16 at a time (a row group). A row group's weights for one of the file's blocks (32
// weights, or 256 for the K formats) form one record: the 16 rows' scales first, then the block's 32-weight
// units, each unit its codes interleaved by row so that one 512-bit load holds 4 consecutive weights of each of
// the 16 rows:
//
//     unpacked byte p = 64 j + 4 r + i   holds the code of row r, weight 4 j + i of the unit  (j < 8, r < 16, i < 4)
//
// Worked example: row 5, weight 13 of a unit: j = 3, i = 1, p = 192 + 20 + 1 = 213. One vpdpbusd of the 64
// bytes of step j against x's weights 4j .. 4j + 3 (broadcast) adds 4 products to each row's int32 lane.
//
// Codes are stored as a nibble plane of 256 bytes (byte p % 256, the low nibble for p < 256, the high one
// above: step j's 64 bytes and step j + 4's share bytes 64 j .. 64 j + 63), then, for 5- and 6-bit codes, a
// plane of high bits: 5-bit, bit p of 64 bytes (step j: the 64-bit word j); 6-bit, two bits of 128 bytes
// (step j: bytes 16 j + (p % 16), at bits 2 ((p % 64) / 16)). Q8_0 keeps whole signed bytes (512 per unit).
//
// A code c stands for w = S c + Mn, with S and Mn per row and unit (Q6_K: per row and 16 weights):
//     Q4_0  S = d, Mn = -8 d        Q4_1  S = d, Mn = m        Q5_0  S = d, Mn = -16 d    Q8_0  w = d q (signed)
//     Q4_K, Q5_K  S = d sc, Mn = -dmin mn (6-bit sc, mn per unit)     Q6_K  S = d sc (int8 per 16), Mn = -32 S
// Every record has its file block's bytes (16 rows of them) or 4 more per row (Q4_K and Q5_K keep each 6-bit
// scale and minimum in a byte of its own): the weights resident stay the file's size.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace tokenmill::gguf {

constexpr int64_t kGroupRows = 16;

struct Layout {
    int64_t weights;      // weights per block (and per record): 32 or 256
    int64_t unit_off;     // the first unit's offset in a record (the scales before it)
    int64_t code_bytes;   // 256 (nibbles) or 512 (Q8_0's bytes)
    int64_t hi_bits;      // 0, 1 (5-bit codes) or 2 (6-bit)
    int64_t m_off;        // Q4_1's m / the K formats' dmin (16 f16), or -1
    int64_t sc_off;       // Q4_K / Q5_K: sc [unit][row] u8 (mn 128 bytes after); Q6_K: sc [16th][row] int8; or -1

    int64_t units() const { return weights / 32; }
    int64_t hi_bytes() const { return hi_bits * 64; }
    int64_t unit_stride() const { return code_bytes + hi_bytes(); }
    int64_t record() const { return unit_off + units() * unit_stride(); }
};

// The layout of ggml type `type` (one of GgmlType); fails on a type not served.
Layout layout_of(int64_t type);

// One call's activations: x [M, K] rounded per 32 to int8 codes q (x ~ dx q), with dx times the sum of each
// unit's 32 codes (ds) and of each half's 16 (ds16: the Mn factors).
struct Act {
    const int8_t* q;     // [M, K]
    const float* dx;     // [M, K / 32]
    const float* ds;     // [M, K / 32]
    const float* ds16;   // [M, K / 16]
    int64_t K;
};

// Every served type, for a switch over them: X(name) per GgmlType name.
#define TOKENMILL_GGUF_TYPES(X) X(q4_0) X(q4_1) X(q5_0) X(q8_0) X(q4_k) X(q5_k) X(q6_k)

// Rows [mb, me) of y [M, G * 16] in T (float or at::BFloat16), rows ldy apart, the columns of groups [g0, g1) of one
// packed part [G, group_bytes] of `type`, on the calling thread (gguf_linear splits the groups of all parts among
// threads). Each kernel sums a row's units in one order whatever rows or groups are asked (batch-invariant).
// False on a type not served.
template <typename T>
bool part_avx2(int64_t type, const uint8_t* packed, int64_t g0, int64_t g1, int64_t group_bytes, const Act& a,
               int64_t mb, int64_t me, T* y, int64_t ldy);
template <typename T>
bool part_vnni(int64_t type, const uint8_t* packed, int64_t g0, int64_t g1, int64_t group_bytes, const Act& a,
               int64_t mb, int64_t me, T* y, int64_t ldy);

}  // namespace tokenmill::gguf
