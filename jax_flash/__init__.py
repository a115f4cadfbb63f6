"""jax_flash: FlashAttention for JAX.

Fused attention kernels (CUDA and C++ CPU) registered as XLA FFI custom calls and exposed as JAX
primitives, so that jit-compiled decoders run them with no host round trip.
"""

from . import reference
from ._native import has_cuda_kernels
from .introspect import kernel_for
from .ops.flash_attention import flash_attention, flash_attention_varlen
from .ops.kv_cache import (
    append_kv,
    append_qkv,
    check_paged_inputs,
    copy_pages,
    reorder_beams,
    slot_mapping,
)
from .ops.paged_attention import paged_attention
from .ops.rope import apply_rope
from .ops.sampling import argmax_tokens, sample, top_k_top_p_filter
from .parallel import context_parallel_attention
from .primitives._common import NativeFallbackWarning

__version__ = "0.1.0"

__all__ = [
    "append_kv",
    "append_qkv",
    "argmax_tokens",
    "apply_rope",
    "check_paged_inputs",
    "context_parallel_attention",
    "copy_pages",
    "flash_attention",
    "flash_attention_varlen",
    "NativeFallbackWarning",
    "has_cuda_kernels",
    "kernel_for",
    "paged_attention",
    "reference",
    "reorder_beams",
    "sample",
    "slot_mapping",
    "top_k_top_p_filter",
]
