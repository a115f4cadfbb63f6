"""Fused prefill attention: `flash_attention` (padded) and `flash_attention_varlen` (packed)."""

from __future__ import annotations

import jax.numpy as jnp

from .. import reference
from ..primitives.flash_attention import FlashBwdLaunch, FlashConfig
from ..primitives.flash_attention_vjp import flash_attention_packed
from ..primitives.sequence_sharding import SEQUENCE_LAYOUTS
from . import _checks

_OP = "flash_attention"
_OP_VARLEN = "flash_attention_varlen"


def _config(
    scale, cap, window, max_seqlen_q, fill_uncovered, implementation, dense, deterministic,
    bwd_launch=None, sequence_layout="auto",
):  # fmt: skip
    if bwd_launch is not None and not isinstance(bwd_launch, FlashBwdLaunch):
        raise TypeError(
            f"{_OP}: _bwd_launch must be a FlashBwdLaunch, got {type(bwd_launch).__name__}"
        )
    if sequence_layout not in SEQUENCE_LAYOUTS:
        raise ValueError(
            f"{_OP}: _sequence_layout must be one of {SEQUENCE_LAYOUTS}, got {sequence_layout!r}"
        )
    launch = {} if bwd_launch is None else {"_bwd_launch": bwd_launch}
    launch["_sequence_layout"] = sequence_layout
    return FlashConfig(
        softmax_scale=scale,
        softcap=cap,
        window_left=window[0],
        window_right=window[1],
        max_seqlen_q=max_seqlen_q,
        fill_uncovered=fill_uncovered,
        implementation=implementation,
        dense=dense,
        deterministic=deterministic,
        **launch,
    )


def _check_qkv(op, q, k, v, rank, layout_q, layout_k, layout_v):
    _checks.array_arg(op, "q", q, rank, layout_q)
    _checks.array_arg(op, "k", k, rank, layout_k)
    _checks.array_arg(op, "v", v, rank, layout_v)
    _checks.float_dtype(op, "q", q)
    _checks.float_dtype(op, "k", k, like=q)
    _checks.float_dtype(op, "v", v, like=q)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{op}: k's head dim {k.shape[-1]} must equal q's {q.shape[-1]} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"{op}: v must have shape {tuple(k.shape[:-1]) + ('Dv',)} to match k "
            f"{tuple(k.shape)}, got {tuple(v.shape)}"
        )
    _checks.heads(op, q.shape[-2], k.shape[-2])


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    q_seqlens=None,
    kv_seqlens=None,
    return_lse: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
    _bwd_launch: FlashBwdLaunch | None = None,
    _sequence_layout: str = "auto",
):
    """Fused multi-head attention ``softmax(q k^T * scale) v`` without materialising the scores.

    Parameters
    ----------
    q : Array ``[B, Sq, Hq, D]`` float32, float16 or bfloat16.
    k : Array ``[B, Skv, Hkv, D]``, same dtype; ``Hq % Hkv == 0`` (GQA/MQA: query head ``h``
        reads key/value head ``h // (Hq // Hkv)``).
    v : Array ``[B, Skv, Hkv, Dv]``, same dtype.
    causal : bool
        Mask keys right of the diagonal, bottom-right aligned when ``Sq != Skv`` (query row ``i``
        sees keys ``j <= i + Skv - Sq``), as FlashAttention >= 2.1.
    softmax_scale : float, default ``1/sqrt(D)``.
    sliding_window : (left, right) or None
        Query row ``i`` sees keys ``i + Skv - Sq - left <= j <= i + Skv - Sq + right``; ``None`` or
        ``-1`` for an unbounded side. With ``causal=True`` right must be None, -1 or 0.
    logits_soft_cap : float or None
        ``s = cap * tanh(s / cap)`` applied to the scaled scores (Gemma 2 style); None/0 = off.
    q_seqlens, kv_seqlens : int array ``[B]`` or None
        Valid lengths of padded batches (clipped to ``[0, S]``). Rows at or past ``q_seqlens[b]``
        give zeros; the masks above use the valid lengths. A row that sees no key gives zeros
        (never NaN) and ``lse = -inf``.
    return_lse : bool
        Also return ``lse [B, Hq, Sq]`` float32, the natural log of each row's softmax denominator.
    implementation : None, "cuda", "cpu" or "xla"
        None runs the native kernel of the platform the computation is placed on (the jnp
        reference on platforms without one); "xla" is :mod:`jax_flash.reference` (pure jnp,
        materialises the scores). The CUDA kernel takes head dims up to 256; for larger ones
        None falls back to the jnp reference (O(S^2) memory) and "cuda" raises a ValueError.
    deterministic : bool
        Gradients only (the forward ignores it): the backward kernel accumulates without
        atomics, so gradients are bit-identical run to run (on CUDA slower than the default,
        which accumulates dq with float32 atomics; the CPU kernel is deterministic either way).
    _bwd_launch : private: how the CUDA backward runs (``FlashBwdLaunch``: which kernel on
        Hopper); None: ``default_bwd_launch()``, from the environment.
    _sequence_layout : private: with the sequence axis sharded under ``jax.jit``, "auto"
        balances a causal mask over the devices (each computes two half-blocks of rows),
        "natural" keeps each device on its own rows (to time the difference).

    Returns
    -------
    o : Array ``[B, Sq, Hq, Dv]`` in q's dtype (accumulated in float32), and ``lse`` when
        ``return_lse``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q = jax.random.normal(kq, (2, 128, 8, 64), jnp.bfloat16)
    >>> k = jax.random.normal(kk, (2, 128, 2, 64), jnp.bfloat16)
    >>> v = jax.random.normal(kv, (2, 128, 2, 64), jnp.bfloat16)
    >>> jax_flash.flash_attention(q, k, v, causal=True).shape
    (2, 128, 8, 64)

    Differentiable in q, k and v (and through ``lse``): the backward recomputes the softmax
    from lse (O(S) extra memory), and rows that see no key get zero gradients.

    >>> dq = jax.grad(lambda q: jax_flash.flash_attention(q, k, v).astype(jnp.float32).sum())(q)
    >>> dq.shape, dq.dtype
    ((2, 128, 8, 64), dtype(bfloat16))
    """
    _check_qkv(_OP, q, k, v, 4, "[B, Sq, Hq, D]", "[B, Skv, Hkv, D]", "[B, Skv, Hkv, Dv]")
    B, Sq, Hq, D = q.shape
    Skv, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape[0] != B:
        raise ValueError(f"{_OP}: k's batch {k.shape[0]} must equal q's {B} (q {tuple(q.shape)})")
    if q_seqlens is not None:
        q_seqlens = _checks.int_vector(_OP, "q_seqlens", q_seqlens, B)
    if kv_seqlens is not None:
        kv_seqlens = _checks.int_vector(_OP, "kv_seqlens", kv_seqlens, B)
    window = reference.normalize_window(causal, sliding_window, _OP)
    scale, cap = _checks.scale_and_cap(_OP, D, softmax_scale, logits_soft_cap)
    _checks.implementation(_OP, implementation)
    deterministic = _checks.boolean(_OP, "deterministic", deterministic)
    if B * max(Sq, Skv) > _checks.INT32_MAX:
        raise ValueError(f"{_OP}: B*S must stay below 2^31 rows, got q {q.shape}, k {k.shape}")

    if implementation == "xla":
        return reference.attention(
            q,
            k,
            v,
            causal=causal,
            softmax_scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=cap,
            q_seqlens=q_seqlens,
            kv_seqlens=kv_seqlens,
            return_lse=return_lse,
        )
    if q.size == 0:
        o = jnp.zeros((B, Sq, Hq, Dv), q.dtype)
        return (o, jnp.full((B, Hq, Sq), -jnp.inf, jnp.float32)) if return_lse else o

    # The packed form: sequence b owns rows [b*S, b*S + len_b).
    q_starts = jnp.arange(B, dtype=jnp.int32) * Sq
    k_starts = jnp.arange(B, dtype=jnp.int32) * Skv
    q_len = jnp.full((B,), Sq, jnp.int32) if q_seqlens is None else jnp.clip(q_seqlens, 0, Sq)
    k_len = jnp.full((B,), Skv, jnp.int32) if kv_seqlens is None else jnp.clip(kv_seqlens, 0, Skv)
    config = _config(
        scale, cap, window, Sq, q_seqlens is not None, implementation, True, deterministic,
        _bwd_launch, _sequence_layout,
    )  # fmt: skip
    o, lse = flash_attention_packed(
        q.reshape(B * Sq, Hq, D),
        k.reshape(B * Skv, Hkv, D),
        v.reshape(B * Skv, Hkv, Dv),
        q_starts,
        q_starts + q_len,
        k_starts,
        k_starts + k_len,
        config=config,
    )
    o = o.reshape(B, Sq, Hq, Dv)
    if not return_lse:
        return o
    return o, lse.reshape(Hq, B, Sq).transpose(1, 0, 2)


def flash_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
):
    """Fused attention over packed sequences of different lengths, with no padding compute.

    Sequence ``b`` owns q rows ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` and k/v rows
    ``cu_seqlens_k[b] : cu_seqlens_k[b+1]``; each attends only within itself, with the options of
    :func:`flash_attention` (causal and windows bottom-right aligned per sequence).

    Parameters
    ----------
    q : Array ``[Tq, Hq, D]`` float32, float16 or bfloat16 (all sequences' rows, packed).
    k : Array ``[Tk, Hkv, D]``; v : Array ``[Tk, Hkv, Dv]``; same dtype, ``Hq % Hkv == 0``.
    cu_seqlens_q, cu_seqlens_k : int32 ``[B+1]``
        Cumulative lengths (``cu[0] = 0`` usually). Device data: each sequence's range is
        clamped into ``[0, T]`` (an end below its start is an empty sequence), so no value causes
        an out-of-bounds access. Rows owned by no sequence (e.g. past ``cu_seqlens_q[B]``) give
        zeros and ``lse = -inf``; a row that clamped query ranges share holds one of their
        results.
    causal, softmax_scale, sliding_window, logits_soft_cap, implementation, deterministic
        As in :func:`flash_attention`.
    return_lse : bool
        Also return ``lse [Hq, Tq]`` float32.

    Returns
    -------
    o : Array ``[Tq, Hq, Dv]`` in q's dtype (and ``lse`` when ``return_lse``).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> lens = [5, 17, 3]
    >>> cu = jnp.array([0, 5, 22, 25], jnp.int32)
    >>> q = jax.random.normal(jax.random.key(0), (25, 4, 64), jnp.float16)
    >>> k = v = jax.random.normal(jax.random.key(1), (25, 4, 64), jnp.float16)
    >>> jax_flash.flash_attention_varlen(q, k, v, cu, cu, causal=True).shape
    (25, 4, 64)
    """
    _check_qkv(_OP_VARLEN, q, k, v, 3, "[Tq, Hq, D]", "[Tk, Hkv, D]", "[Tk, Hkv, Dv]")
    Tq, Hq, D = q.shape
    Dv = v.shape[2]
    if not hasattr(cu_seqlens_q, "shape") or cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(
            f"{_OP_VARLEN}: cu_seqlens_q must have shape (B+1,), got "
            f"{getattr(cu_seqlens_q, 'shape', type(cu_seqlens_q).__name__)}"
        )
    nb = cu_seqlens_q.shape[0]
    cu_seqlens_q = _checks.int_vector(_OP_VARLEN, "cu_seqlens_q", cu_seqlens_q, nb)
    cu_seqlens_k = _checks.int_vector(_OP_VARLEN, "cu_seqlens_k", cu_seqlens_k, nb)
    window = reference.normalize_window(causal, sliding_window, _OP_VARLEN)
    scale, cap = _checks.scale_and_cap(_OP_VARLEN, D, softmax_scale, logits_soft_cap)
    _checks.implementation(_OP_VARLEN, implementation)
    deterministic = _checks.boolean(_OP_VARLEN, "deterministic", deterministic)
    if max(Tq, k.shape[0]) > _checks.INT32_MAX:
        raise ValueError(f"{_OP_VARLEN}: more than 2^31-1 packed rows")

    if implementation == "xla":
        return reference.attention_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            causal=causal,
            softmax_scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=cap,
            return_lse=return_lse,
        )
    if q.size == 0:
        o = jnp.zeros((Tq, Hq, Dv), q.dtype)
        return (o, jnp.full((Hq, Tq), -jnp.inf, jnp.float32)) if return_lse else o

    config = _config(scale, cap, window, Tq, True, implementation, False, deterministic)
    o, lse = flash_attention_packed(
        q,
        k,
        v,
        cu_seqlens_q[:-1],
        cu_seqlens_q[1:],
        cu_seqlens_k[:-1],
        cu_seqlens_k[1:],
        config=config,
    )
    return (o, lse) if return_lse else o
