"""Every version-dependent JAX import of jax_flash, in one place.

Supported: jax/jaxlib >= 0.10.0 (tested with 0.10.2 on CPU and 0.11.2 with CUDA 13).
"""

import jax
from jax import ffi
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

ShapedArray = jax.core.ShapedArray

# The batch dimension a batching rule receives for an operand that vmap does not map.
NOT_MAPPED = None

__all__ = ["NOT_MAPPED", "Primitive", "ShapedArray", "batching", "ffi", "mlir"]
