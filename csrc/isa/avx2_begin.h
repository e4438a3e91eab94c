// Opens a region whose functions are compiled for AVX2 with FMA and F16C (Haswell, Zen and later: most
// laptops and AMD servers), whatever the build's -march: include it after every library header, close it
// with avx2_end.h. Code in the region may run only where cpu_has_avx2() says so: each op checks that at
// run time and takes its generic path otherwise (docs/native_kernels.md). Every AVX-512 CPU also passes
// cpu_has_avx2(), so these paths serve the avx512 levels too where no AVX-512 kernel does.
// NOTE: no include guard: a file may open and close several regions.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
