// Opens a region whose functions are compiled for AVX-512 with VNNI (vpdpbusd: u8 x s8 dot products into
// int32 lanes; Cascade Lake, Zen 4, Sapphire Rapids and later), whatever the build's -march: include it
// after every library header, close it with avx512_end.h. Code in the region may run only where
// cpu_has_avx512_vnni() says so. NOTE: no include guard: a file may open and close several regions.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,f16c")
#endif
