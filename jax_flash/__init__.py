"""jax_flash: FlashAttention for JAX.

Fused attention kernels (CUDA and C++ CPU) registered as XLA FFI custom calls and exposed as JAX
primitives, so that jit-compiled decoders run them with no host round trip.
"""

from . import reference
from ._native import has_cuda_kernels
from .ops.flash_attention import flash_attention, flash_attention_varlen

__version__ = "0.1.0"

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "has_cuda_kernels",
    "reference",
]
