// Shared by every kernel file: scalar conversions, the row loop, and the CPU features found at run time.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tokenmill {

// The instruction sets a kernel may need, lowest first (avx2: AVX2 + FMA + F16C; amx: avx512_bf16 plus
// AMX-BF16 tiles); each level has every instruction set of the ones below it. The level in force is the
// highest this CPU and its OS support, capped by TOKENMILL_ISA or set_max_isa (tests use that to run the
// generic paths).
enum class Isa : int { generic = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };

Isa detected_isa();           // what the CPU and OS support
Isa current_isa();            // min(detected, cap)
Isa set_max_isa(Isa cap);     // returns the previous cap
const char* isa_name(Isa isa);
Isa isa_from_name(const std::string& name);   // throws on an unknown name

inline bool cpu_has_avx2() { return current_isa() >= Isa::avx2; }   // AVX2 + FMA + F16C
inline bool cpu_has_avx512() { return current_isa() >= Isa::avx512; }
inline bool cpu_has_avx512_bf16() { return current_isa() >= Isa::avx512_bf16; }
inline bool cpu_has_amx() { return current_isa() >= Isa::amx; }   // AMX-BF16 tiles, granted by the OS

bool os_allows_amx();         // asks Linux for the AMX tile state once (gemm_amx.cpp)
// AVX512-VNNI (vpdpbusd) beside the level: not a level of its own, since AVX-512 CPUs without it
// (Skylake-X) and with it but without BF16 (Cascade Lake) both exist. True only at the avx512 level or above.
bool cpu_has_avx512_vnni();

inline float ld(float x) { return x; }
inline float ld(at::BFloat16 x) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}
template <typename T> inline T st(float x) { return static_cast<T>(x); }   // round to nearest even for bf16

// Rows are independent; small calls run on the calling thread: a parallel region costs a few us. From
// ~16K elements on both threads pay (AMX host, bf16, 34 rows x 576: add_rms_norm 18.7 -> 13.0 us, RoPE
// 32.0 -> 20.0 us; at 64K, the old threshold, a 30-stream decode step ran all its glue ops on one thread).
template <typename F>
inline void for_rows(int64_t n_rows, int64_t row_elems, const F& f) {
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(row_elems, 1));
    at::parallel_for(0, n_rows, grain, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) f(i); });
}

// Tasks of uneven cost (attention over rows of 30 to 1,000 keys) on every thread, each thread taking the next
// task from a shared counter: `body(next)` runs once per thread and calls next() until it returns -1. Tasks
// come out in index order, so a caller that lists the heaviest first gets a longest-first schedule. A static
// split into equal index ranges (at::parallel_for) left one thread spinning at the region's end whenever its
// half held the long rows. Equal tasks that stream memory in order (the AMX GEMM's chunks) keep the static
// split: interleaved, the prefetchers serve them worse (docs/native_kernels.md, "Threads"). Serial when
// `parallel` is false (small calls: a parallel region costs a few us) or inside another parallel region.
template <typename F>
inline void parallel_tasks(int64_t num_tasks, bool parallel, const F& body) {
    const int64_t threads = parallel ? std::min<int64_t>(at::get_num_threads(), num_tasks) : 1;
    if (threads <= 1 || at::in_parallel_region()) {
        int64_t i = 0;
        body([&]() -> int64_t { return i < num_tasks ? i++ : -1; });
        return;
    }
    std::atomic<int64_t> counter{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        body([&]() -> int64_t {
            const int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
            return i < num_tasks ? i : -1;
        });
    });
}

}  // namespace tokenmill

// float32 or bfloat16 tensors only: runs the statement with T bound to the element type.
#define TOKENMILL_DISPATCH_FLOAT(t, name, ...)                                          \
    if ((t).scalar_type() == at::kFloat) { using T = float; __VA_ARGS__; }              \
    else if ((t).scalar_type() == at::kBFloat16) { using T = at::BFloat16; __VA_ARGS__; } \
    else TORCH_CHECK(false, name ": float32 or bfloat16 only")
