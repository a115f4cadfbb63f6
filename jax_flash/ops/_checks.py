"""Argument checks shared by the ops: clear Python errors before anything is traced or run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
IMPLEMENTATIONS = (None, "cuda", "cpu", "xla")
INT32_MAX = 2**31 - 1


def array_arg(op: str, name: str, x, ndim: int, layout: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an array {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim} {layout}, got shape {tuple(x.shape)}")
    return x


def float_dtype(op: str, name: str, x, like=None):
    if like is not None:
        if x.dtype != like.dtype:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}, expected {like.dtype} (as q)")
    elif not any(x.dtype == d for d in FLOAT_DTYPES):
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; float32, float16 or bfloat16 expected")


def int_vector(op: str, name: str, x, length: int):
    """An integer vector of the given length, as int32."""
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if tuple(x.shape) != (length,):
        raise ValueError(f"{op}: {name} must have shape ({length},), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{op}: {name} must be an integer array, got dtype {x.dtype}")
    return jnp.asarray(x, jnp.int32)


def boolean(op: str, name: str, x) -> bool:
    """A Python (or NumPy) bool, known when tracing."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool, got {x!r} ({type(x).__name__})")
    return bool(x)


def static_int(op: str, name: str, x, minimum: int) -> int:
    """A Python (or NumPy) int >= minimum, known when tracing: shapes and loop bounds."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {x!r} ({type(x).__name__})")
    if x < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {x}")
    return int(x)


def heads(op: str, hq: int, hkv: int):
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"{op}: the number of query heads ({hq}) must be a positive multiple of the number of "
            f"key/value heads ({hkv})"
        )


def implementation(op: str, impl):
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")


def scale_and_cap(op: str, head_dim: int, softmax_scale, logits_soft_cap) -> tuple[float, float]:
    if head_dim < 1:
        # Scores of empty vectors are all 0: no query-key match to attend by (and 1/sqrt(0)).
        raise ValueError(
            f"{op}: the head dim D (last axis of q and k) must be >= 1, got D = {head_dim}"
        )
    scale = float(head_dim) ** -0.5 if softmax_scale is None else float(softmax_scale)
    cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if not np.isfinite(scale):
        raise ValueError(f"{op}: softmax_scale must be finite, got {softmax_scale!r}")
    if cap < 0 or not np.isfinite(cap):
        raise ValueError(f"{op}: logits_soft_cap must be None or >= 0 (0 = off), got {cap!r}")
    return scale, cap
