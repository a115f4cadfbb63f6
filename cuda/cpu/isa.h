// Run-time choice of the widest x86 code path, shared by the CPU kernels. Kernels compile their
// inner loops once per target (JF_TARGET_AVX2 / JF_TARGET_AVX512 functions) and call
// detect_isa() to pick one; JAX_FLASH_CPU_ISA=generic|avx2 caps the choice.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JF_X86_DISPATCH 1
#define JF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define JF_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#else
#define JF_X86_DISPATCH 0
#endif

namespace jax_flash::cpu {

enum class Isa { kGeneric, kAvx2, kAvx512 };

inline Isa detect_isa() {
#if JF_X86_DISPATCH
  static const Isa isa = [] {
    Isa cap = Isa::kAvx512;
    if (const char* env = std::getenv("JAX_FLASH_CPU_ISA")) {
      if (std::strcmp(env, "generic") == 0) cap = Isa::kGeneric;
      if (std::strcmp(env, "avx2") == 0) cap = Isa::kAvx2;
    }
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
    if (avx512 && cap == Isa::kAvx512) return Isa::kAvx512;
    if (avx2 && cap != Isa::kGeneric) return Isa::kAvx2;
    return Isa::kGeneric;
  }();
  return isa;
#else
  return Isa::kGeneric;
#endif
}

}  // namespace jax_flash::cpu
