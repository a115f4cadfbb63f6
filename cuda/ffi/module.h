// The body shared by the nanobind modules _cpu and _cuda: registrations() -> {target name:
// capsule}.
#pragma once

#include <nanobind/nanobind.h>

#include "registry.h"

namespace jax_flash {

inline void def_registrations(nanobind::module_& m) {
  m.def("registrations", []() {
    nanobind::dict d;
    for (const auto& [name, fn] : ffi_registry())
      d[name] = nanobind::capsule(reinterpret_cast<void*>(fn));
    return d;
  });
}

}  // namespace jax_flash
