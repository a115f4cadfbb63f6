// nanobind module _cuda: every CUDA FFI handler registered in this library. Linked against the
// static CUDA runtime, so importing it needs no libcudart (and no GPU).
#include "module.h"

NB_MODULE(_cuda, m) { jax_flash::def_registrations(m); }
