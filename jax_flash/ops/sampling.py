"""Sampling from logits: `sample`, its greedy choice `argmax_tokens`, and `top_k_top_p_filter`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..primitives.sampling import SamplingConfig, sample_p, top_k_top_p_filter_p
from . import _checks

MAX_VOCAB = 2**24 - 1  # sampling_params.h: kMaxVocab (sums of 40-bit masses fit in uint64)


def _is_scalar(v) -> bool:
    return not hasattr(v, "shape") or v.ndim == 0


def _concrete(v):
    """v as a Python number, or None when it is a traced value."""
    try:
        return np.asarray(v).item()
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def _row_param(op: str, name: str, value, batch: int, integer: bool, valid, expected: str):
    """A per-row parameter as a [batch] int32 / float32 array; scalars are range-checked."""
    dtype = jnp.int32 if integer else jnp.float32
    if isinstance(value, bool) or (hasattr(value, "dtype") and value.dtype == bool):
        raise TypeError(f"{op}: {name} must be a number or a [B] array, got a bool")
    if hasattr(value, "dtype") or isinstance(value, (int, float, np.number)):
        kind_ok = jnp.issubdtype(jnp.asarray(value).dtype, jnp.integer) or (
            not integer and jnp.issubdtype(jnp.asarray(value).dtype, jnp.floating)
        )
    else:
        kind_ok = False
    if not kind_ok:
        what = "an integer" if integer else "a number"
        raise TypeError(f"{op}: {name} must be {what} or a [B] array, got {value!r}")
    if not _is_scalar(value):
        if tuple(value.shape) != (batch,):
            raise ValueError(
                f"{op}: {name} must be a scalar or have shape ({batch},) (one per row), got "
                f"{tuple(value.shape)}"
            )
        return jnp.asarray(value).astype(dtype)
    v = _concrete(value)
    if v is not None and not valid(v):
        raise ValueError(f"{op}: {name} must be {expected}, got {v!r}")
    return jnp.broadcast_to(jnp.asarray(value).astype(dtype), (batch,))


def _params(op, batch, temperature, top_k, top_p, min_p):
    return (
        _row_param(
            op, "temperature", temperature, batch, False,
            lambda v: math.isfinite(v) and v >= 0, "finite and >= 0 (0 = greedy)",
        ),
        _row_param(op, "top_k", top_k, batch, True, lambda v: v >= 0, ">= 0 (0 = off)"),
        _row_param(op, "top_p", top_p, batch, False, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
        _row_param(op, "min_p", min_p, batch, False, lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    )  # fmt: skip


def _check_logits(op, logits):
    _checks.array_arg(op, "logits", logits, 2, "[B, V]")
    _checks.float_dtype(op, "logits", logits)
    B, V = logits.shape
    if not 1 <= V <= MAX_VOCAB:
        raise ValueError(f"{op}: the vocabulary size V must be in [1, 2^24 - 1], got {V}")
    return B, V


def _check_key(op, key):
    if hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"{op}: key must be one PRNG key (shape ()), got shape {tuple(key.shape)}; "
                "jax.vmap over keys draws with several"
            )
        return
    if hasattr(key, "dtype") and key.dtype == jnp.uint32 and tuple(key.shape) == (2,):
        return  # a raw (legacy) key
    raise TypeError(
        f"{op}: key must be a JAX PRNG key such as jax.random.key(0), got "
        f"{getattr(key, 'dtype', type(key).__name__)} {tuple(getattr(key, 'shape', ()))}"
    )


_SEMANTICS = """
    Semantics, per row, in this order (``cuda/include/jax_flash/sampling_params.h``):

    1. Tokens are ranked by logit, descending; equal logits by index, ascending. Every filter
       keeps a prefix of this order; the kept set is the intersection (the shortest prefix).
       NaN logits count as -inf.
    2. ``probs = softmax(logits / temperature)``; ``temperature = 0`` is greedy: only the
       first token of the order (the argmax, lowest index on ties) is kept.
    3. ``top_k`` (0 = off): the first ``top_k`` tokens. Ties at the k-th value are cut by index:
       exactly ``top_k`` tokens are kept.
    4. ``top_p`` (1.0 = off): within the top-k set, the shortest prefix whose probability,
       renormalised over the top-k set, reaches ``top_p`` (at least one token). The kernels sum
       probabilities as exact fixed-point integers (``floor(p / p_max * 2^40)``), so the cut does
       not depend on summation order.
    5. ``min_p`` (0.0 = off): tokens with ``prob >= min_p * max(prob)``.

    Each parameter is a Python scalar (checked) or a per-row ``[B]`` array (not checked: values
    <= 0 mean off for ``top_k`` and ``min_p``, >= 1 means off for ``top_p`` and <= 0 keeps one
    token, ``temperature`` <= 0 or NaN is greedy, ``min_p > 1`` acts as 1).
"""


def sample(
    logits,
    key,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    implementation: str | None = None,
):
    """Draw one token per row from the filtered, renormalised softmax of ``logits``.
    {semantics}
    The draw is exact sampling from the kept tokens' renormalised probabilities, by the
    Gumbel-max trick: ``argmax(logits / temperature + g)`` over the kept tokens with ``g``
    Gumbel noise from Philox4x32-10 (a counter-based generator keyed by two words drawn from
    ``key`` with ``jax.random.bits``; token i of row b uses counter ``(i // 4, b)``). The same key
    gives the same tokens: eager or under ``jit``, and under ``vmap`` (each mapped key draws what
    it draws alone). CPU and CUDA make bit-identical decisions (their exp/log are the same IEEE
    operations), so they return the same tokens for the same key. The CUDA kernel never sorts
    the vocabulary: a radix select over the logits finds each cut (one CTA per row, V up to
    2^24 - 1).

    Parameters
    ----------
    logits : Array ``[B, V]`` float32, float16 or bfloat16.
    key : a JAX PRNG key (``jax.random.key(seed)``, or a raw ``uint32[2]`` key), one per call.
    temperature, top_k, top_p, min_p : scalar or ``[B]`` array (see above).
    implementation : None, "cuda", "cpu" or "xla"
        None runs the native kernel of the platform the computation is placed on; "xla" is
        :func:`jax_flash.reference.sample` (sorts; sums probabilities in float32, so a top-p cut
        within float rounding of ``top_p`` may differ; otherwise the same tokens as the kernels).

    Returns
    -------
    tokens : int32 ``[B]``; -1 for a row whose logits are all -inf or NaN.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> logits = jax.random.normal(jax.random.key(0), (4, 32000))
    >>> tokens = jax_flash.sample(logits, jax.random.key(1), temperature=0.7, top_k=50, top_p=0.9)
    >>> tokens.shape, tokens.dtype
    ((4,), dtype('int32'))
    >>> bool((jax_flash.sample(logits, jax.random.key(1), temperature=0.0)
    ...       == jnp.argmax(logits, axis=-1)).all())
    True
    """
    op = "sample"
    B, V = _check_logits(op, logits)
    _check_key(op, key)
    params = _params(op, B, temperature, top_k, top_p, min_p)
    _checks.implementation(op, implementation)
    seeds = reference.sampling_seeds(key, B)
    if implementation == "xla":
        return reference.sample(logits, seeds, *params)
    if B == 0:
        return jnp.zeros((0,), jnp.int32)
    (tokens,) = sample_p.bind(logits, *params, seeds, config=SamplingConfig(implementation))
    return tokens


def argmax_tokens(logits):
    """The token :func:`sample` draws with ``temperature=0`` (greedy decoding), by one XLA
    reduction instead of the sampling kernel: per row the first index of the largest logit, NaN
    counting as -inf (and -0 as 0); -1 for a row with no finite logit. The same tokens on every
    platform.

    Parameters
    ----------
    logits : Array ``[B, V]`` float32, float16 or bfloat16.

    Returns
    -------
    tokens : int32 ``[B]``.

    Examples
    --------
    >>> import jax.numpy as jnp, jax_flash
    >>> jax_flash.argmax_tokens(jnp.array([[0.0, 2.0, 2.0], [jnp.nan, -jnp.inf, -jnp.inf]]))
    Array([ 1, -1], dtype=int32)
    """
    _check_logits("argmax_tokens", logits)
    x = reference._normalize_logits(logits)
    token = jnp.argmax(x, axis=-1, keepdims=True)
    top = jnp.take_along_axis(x, token, axis=-1)  # the row's largest (normalized) logit
    return jnp.where(top > -jnp.inf, token, -1)[:, 0].astype(jnp.int32)


def top_k_top_p_filter(
    logits,
    *,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    temperature=1.0,
    implementation: str | None = None,
):
    """Mask the logits outside the set :func:`sample` would draw from.
    {semantics}
    Parameters
    ----------
    logits : Array ``[B, V]`` float32, float16 or bfloat16.
    top_k, top_p, min_p, temperature : scalar or ``[B]`` array (see above).
    implementation : None, "cuda", "cpu" or "xla" (as in :func:`sample`).

    Returns
    -------
    Array ``[B, V]`` in the logits' dtype: ``logits / temperature`` for kept tokens, ``-inf``
    elsewhere (for a greedy row the argmax keeps its logit). ``jax.random.categorical`` on it
    samples the distribution :func:`sample` samples.

    Examples
    --------
    >>> import jax.numpy as jnp, jax_flash
    >>> logits = jnp.log(jnp.array([[0.5, 0.2, 0.2, 0.1]]))
    >>> jax_flash.top_k_top_p_filter(logits, top_p=0.8)  # 0.5 + 0.2 + 0.2 >= 0.8
    Array([[-0.6931472, -1.609438 , -1.609438 ,       -inf]], dtype=float32)
    >>> jax_flash.top_k_top_p_filter(logits, top_k=2)  # the tie at 0.2 is cut by index
    Array([[-0.6931472, -1.609438 ,       -inf,       -inf]], dtype=float32)
    """
    op = "top_k_top_p_filter"
    B, _ = _check_logits(op, logits)
    params = _params(op, B, temperature, top_k, top_p, min_p)
    _checks.implementation(op, implementation)
    if implementation == "xla":
        return reference.top_k_top_p_filter(logits, *params)
    if B == 0:
        return logits
    (out,) = top_k_top_p_filter_p.bind(logits, *params, config=SamplingConfig(implementation))
    return out


sample.__doc__ = sample.__doc__.format(semantics=_SEMANTICS)
top_k_top_p_filter.__doc__ = top_k_top_p_filter.__doc__.format(semantics=_SEMANTICS)
