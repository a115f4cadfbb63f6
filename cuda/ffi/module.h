// The body of the nanobind modules _cpu and _cuda: registrations() -> {target name: capsule}.
#pragma once

#include <nanobind/nanobind.h>

#include "registry.h"

#define JAX_FLASH_FFI_MODULE(module_name)                                   \
  NB_MODULE(module_name, m) {                                               \
    m.def("registrations", []() {                                           \
      nanobind::dict d;                                                     \
      for (const auto& [name, fn] : ::jax_flash::ffi_registry())            \
        d[name] = nanobind::capsule(reinterpret_cast<void*>(fn));           \
      return d;                                                             \
    });                                                                     \
  }
