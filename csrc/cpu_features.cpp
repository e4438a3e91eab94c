// The instruction sets found at run time, and the cap that tests and TOKENMILL_ISA put on them.
#include "common.h"

#include <atomic>
#include <cstdlib>
#include <string>

namespace tokenmill {

static Isa detect() {
#if defined(__x86_64__) || defined(__i386__)
    // __builtin_cpu_supports also checks that the OS saves the ymm / AVX-512 state (XCR0).
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    // The AVX-512 regions are compiled with AVX2 and FMA too (isa/avx512_begin.h): every level above avx2 has it.
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
    if (bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && os_allows_amx())
        return Isa::amx;
    if (bf16) return Isa::avx512_bf16;
    if (avx512) return Isa::avx512;
    if (avx2) return Isa::avx2;
#endif
    return Isa::generic;
}

static Isa initial_cap() {
    const char* env = std::getenv("TOKENMILL_ISA");
    return env && *env ? isa_from_name(env) : Isa::amx;
}

static std::atomic<int>& cap_slot() {
    static std::atomic<int> cap(static_cast<int>(initial_cap()));
    return cap;
}

Isa detected_isa() {
    static const Isa isa = detect();
    return isa;
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool vnni = detected_isa() >= Isa::avx512 && __builtin_cpu_supports("avx512vnni");
    return vnni && current_isa() >= Isa::avx512;
#else
    return false;
#endif
}

Isa current_isa() { return static_cast<Isa>(std::min(static_cast<int>(detected_isa()), cap_slot().load())); }

Isa set_max_isa(Isa cap) { return static_cast<Isa>(cap_slot().exchange(static_cast<int>(cap))); }

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::amx: return "amx";
        case Isa::avx512_bf16: return "avx512_bf16";
        case Isa::avx512: return "avx512";
        case Isa::avx2: return "avx2";
        default: return "generic";
    }
}

Isa isa_from_name(const std::string& name) {
    if (name == "amx") return Isa::amx;
    if (name == "avx512_bf16") return Isa::avx512_bf16;
    if (name == "avx512") return Isa::avx512;
    if (name == "avx2") return Isa::avx2;
    if (name == "generic") return Isa::generic;
    TORCH_CHECK(false, "TOKENMILL_ISA: unknown instruction set '", name, "' (generic, avx2, avx512, avx512_bf16, amx)");
}

}  // namespace tokenmill
