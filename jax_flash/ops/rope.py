"""Rotary position embeddings: `apply_rope`."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from .. import reference
from ..primitives.rope import MAX_ROTARY_DIM, STYLES, RopeConfig, rope_p
from . import _checks

_OP = "apply_rope"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _positive(name: str, value, op: str = _OP) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{op}: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: {name} must be finite and > 0, got {value!r}")
    return float(value)


def _check_scaling(scaling, op: str = _OP, name: str = "scaling") -> dict | None:
    """The validated frequency scaling (None for none)."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{op}: {name} must be None or a dict, got {type(scaling).__name__}")
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind == "default":
        return None
    if kind == "linear":
        factor = _positive(f"{name}['factor']", scaling.get("factor"), op)
        return {"type": "linear", "factor": factor}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise ValueError(
                f"{op}: llama3 {name} needs the keys {list(_LLAMA3_KEYS)}, missing {missing}"
            )
        out = {"type": "llama3"}
        out.update({k: _positive(f"{name}[{k!r}]", scaling[k], op) for k in _LLAMA3_KEYS})
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(
                f"{op}: {name}['high_freq_factor'] ({out['high_freq_factor']}) must be greater "
                f"than {name}['low_freq_factor'] ({out['low_freq_factor']})"
            )
        return out
    raise ValueError(
        f"{op}: {name}['type'] must be 'default', 'linear' or 'llama3', got {kind!r} "
        f"({name}={dict(scaling)!r})"
    )


def _check_positions(x, positions):
    if not hasattr(positions, "shape"):
        positions = np.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"{_OP}: positions must be an integer array, got dtype {positions.dtype}")
    lead = tuple(x.shape[:-2])
    try:
        ok = np.broadcast_shapes(tuple(positions.shape), lead) == lead
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{_OP}: positions must broadcast to x's leading dims {lead} ([..., S]), got shape "
            f"{tuple(positions.shape)}"
        )
    return positions


def rope_options(
    op, head_dim, *, style="neox", rotary_dim=None, theta=10000.0, scaling=None, key=None,
    where="",
):  # fmt: skip
    """Checks apply_rope's options; returns ``(rotary_dim, inv_freq)``. ``key(name)`` names an
    option in the messages (append_kv: ``rope['theta']``); ``where`` says whose D it is."""
    key = key or (lambda name: name)
    if style not in STYLES:
        raise ValueError(f"{op}: {key('style')} must be 'neox' or 'gptj', got {style!r}")
    D = head_dim
    rd = D if rotary_dim is None else rotary_dim
    if isinstance(rd, bool) or not isinstance(rd, (int, np.integer)):
        raise TypeError(f"{op}: {key('rotary_dim')} must be an int or None, got {rotary_dim!r}")
    rd = int(rd)
    if rd < 2 or rd % 2 or rd > D:
        raise ValueError(
            f"{op}: {key('rotary_dim')} must be even and in [2, D={D}] ({where}), got {rd}"
        )
    theta = _positive(key("theta"), theta, op)
    scaling = _check_scaling(scaling, op, key("scaling"))
    return rd, reference.rope_inv_freq(rd, theta, scaling)


def apply_rope(
    x,
    positions,
    *,
    style: str = "neox",
    rotary_dim: int | None = None,
    theta: float = 10000.0,
    scaling: dict | None = None,
    implementation: str | None = None,
):
    """Rotary position embeddings (RoPE) of queries or keys.

    Each head's first ``rotary_dim`` features are rotated in pairs ``(a, b)`` by the angle
    ``positions * inv_freq[i]``: ``a' = a cos - b sin``, ``b' = b cos + a sin``; the other
    features pass through. ``inv_freq[i] = theta ** (-2i / rotary_dim)``, then the frequency
    scaling; it is computed on the host in float32 exactly as Hugging Face transformers does
    (:func:`jax_flash.reference.rope_inv_freq`) and handed to the kernels, which compute each
    angle as one float32 product and its cos/sin in float32 (accurate functions, no tables).

    Parameters
    ----------
    x : Array ``[..., S, H, D]`` float32, float16 or bfloat16.
    positions : int array ``[..., S]``, broadcast against x's leading dims ``[..., S]``: the
        position of every token, any values (not only ``0..S-1``; exact up to ``|pos| < 2^24``).
    style : "neox" or "gptj"
        "neox" (Llama, GPT-NeoX, Hugging Face ``rotate_half``): pairs ``(i, i + rotary_dim/2)``,
        i.e. ``out = x cos + rotate_half(x) sin`` with ``cos = cat(cos(f), cos(f))``.
        "gptj" (GPT-J, interleaved): pairs ``(2i, 2i + 1)``.
    rotary_dim : int, default D
        Even, ``2 <= rotary_dim <= D``; partial rotary embeddings (GPT-NeoX, Phi) rotate the
        first ``rotary_dim`` features only. The native kernels take ``rotary_dim <= 512``.
    theta : float, default 10000.0
        The RoPE base (Llama 3: 500000.0).
    scaling : dict or None
        Frequency scaling, keys as in a Hugging Face ``config.json`` ``rope_scaling``
        (``"rope_type"`` may replace ``"type"``):
        ``{"type": "linear", "factor": f}`` divides the frequencies by f (positions / f);
        ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`` is Llama 3.1's wavelength-dependent scaling
        (transformers' ``_compute_llama3_parameters``); None or ``{"type": "default"}``: none.
    implementation : None, "cuda", "cpu" or "xla"
        None runs the native kernel of the platform the computation is placed on (the jnp
        reference elsewhere); "xla" is :func:`jax_flash.reference.apply_rope`.

    Returns
    -------
    Array like x (same shape and dtype); the rotation runs in float32.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 8, 128), jnp.bfloat16)  # [B, S, H, D]
    >>> pos = jnp.arange(16, dtype=jnp.int32) + 100                              # [S]
    >>> llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ...           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    >>> jax_flash.apply_rope(q, pos, theta=500000.0, scaling=llama3).shape
    (2, 16, 8, 128)
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{_OP}: x must be an array [..., S, H, D], got {type(x).__name__}")
    if x.ndim < 3:
        raise ValueError(f"{_OP}: x must have rank >= 3 [..., S, H, D], got shape {tuple(x.shape)}")
    _checks.float_dtype(_OP, "x", x)
    positions = _check_positions(x, positions)
    _checks.implementation(_OP, implementation)
    rd, inv_freq = rope_options(
        _OP, x.shape[-1], style=style, rotary_dim=rotary_dim, theta=theta, scaling=scaling,
        where=f"x {tuple(x.shape)}",
    )  # fmt: skip

    if implementation == "xla":
        return reference.apply_rope(x, positions, inv_freq, style=style, rotary_dim=rd)
    if rd > MAX_ROTARY_DIM:
        raise ValueError(
            f"{_OP}: the native kernels take rotary_dim up to {MAX_ROTARY_DIM}, got {rd}; use "
            "implementation='xla'"
        )
    if x.size == 0:
        return x
    H, D = x.shape[-2:]
    pos = jnp.broadcast_to(jnp.asarray(positions).astype(jnp.int32), x.shape[:-2]).reshape(-1)
    config = RopeConfig(style, rd, tuple(float(v) for v in inv_freq), implementation)
    (out,) = rope_p.bind(x.reshape(-1, H, D), pos, config=config)
    return out.reshape(x.shape)
