// nanobind module _cpu: the CPU FFI handlers, by target name.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxFlashAttentionCpu(XLA_FFI_CallFrame*);

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_flash_flash_attention_cpu"] =
        nb::capsule(reinterpret_cast<void*>(&JaxFlashAttentionCpu));
    return d;
  });
}
