// Opens a region whose functions are compiled for AVX-512 (F, BW, VL, DQ) with AVX512-BF16, whatever
// the build's -march: include it after every library header, close it with avx512_end.h. Code in the
// region may run only where cpu_has_avx512() (or cpu_has_avx512_bf16() for the bf16 instructions)
// says so: each op checks that at run time and takes its generic path otherwise (docs/native_kernels.md).
// NOTE: no include guard: a file may open and close several regions.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2,f16c")
#endif
