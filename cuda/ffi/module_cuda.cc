// nanobind module _cuda: every CUDA FFI handler registered in this library. Linked against the
// static CUDA runtime, so importing it needs no libcudart (and no GPU).
#include "module.h"

JAX_FLASH_FFI_MODULE(_cuda)
