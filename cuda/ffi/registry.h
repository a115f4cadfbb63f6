// Each FFI handler file registers its handler here at static-initialisation time; the nanobind
// module of its platform hands them all to JAX through registrations(). Adding an op therefore
// touches only its own files.
#pragma once

#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jax_flash {

using FfiHandlerFn = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

inline std::vector<std::pair<const char*, FfiHandlerFn>>& ffi_registry() {
  static std::vector<std::pair<const char*, FfiHandlerFn>> handlers;
  return handlers;
}

struct FfiRegistrar {
  FfiRegistrar(const char* target_name, FfiHandlerFn fn) {
    ffi_registry().emplace_back(target_name, fn);
  }
};

}  // namespace jax_flash

// JAX_FLASH_REGISTER_FFI("jax_flash_<op>_<platform>", HandlerSymbol);
#define JAX_FLASH_REGISTER_FFI_CAT2(a, b) a##b
#define JAX_FLASH_REGISTER_FFI_CAT(a, b) JAX_FLASH_REGISTER_FFI_CAT2(a, b)
#define JAX_FLASH_REGISTER_FFI(name, fn)                                                    \
  static ::jax_flash::FfiRegistrar JAX_FLASH_REGISTER_FFI_CAT(jax_flash_registrar_, __LINE__)( \
      name, fn)
