// nanobind module _cpu: every CPU FFI handler registered in this library.
#include "module.h"

JAX_FLASH_FFI_MODULE(_cpu)
