// nanobind module _cuda: the CUDA FFI handlers, by target name. Linked against the static CUDA
// runtime, so importing it needs no libcudart (and no GPU).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxFlashAttentionCuda(XLA_FFI_CallFrame*);

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_flash_flash_attention_cuda"] =
        nb::capsule(reinterpret_cast<void*>(&JaxFlashAttentionCuda));
    return d;
  });
}
