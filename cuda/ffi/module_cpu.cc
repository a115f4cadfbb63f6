// nanobind module _cpu: every CPU FFI handler registered in this library, and `policy`, the
// decisions and limits of the CUDA kernels (always built, so Python has them on any machine).
#include "module.h"
#include "policy_module.h"

NB_MODULE(_cpu, m) {
  jax_flash::def_registrations(m);
  jax_flash::def_policy_module(m);
}
