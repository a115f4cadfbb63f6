"""Pure-jnp reference attention (float32, highest precision).

It is the oracle of the tests and the `implementation="xla"` path of every op. It materialises the
full score matrix, so it needs O(Sq*Skv) memory: fine for checking, not for long sequences.

Masking (shared by every implementation): with sq query rows and sk key rows in a sequence,
bottom-right aligned, query row i sees key j iff
``j >= i + sk - sq - left`` (when left >= 0) and ``j <= i + sk - sq + right`` (when right >= 0).
Causal attention is right = 0. Rows that see no key give o = 0 and lse = -inf.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

_HI = jax.lax.Precision.HIGHEST

# Windows wider than this are unbounded; keeps the kernels' index arithmetic in int32.
_MAX_WINDOW = 1 << 30


def normalize_window(causal, sliding_window, op: str = "jax_flash") -> tuple[int, int]:
    """(left, right) window with -1 for "unbounded"; causal sets right = 0.

    ``causal`` is a bool (Python or NumPy); ``sliding_window`` is None or a pair
    ``(left, right)`` of ints, each None or -1 for unbounded. Anything else raises, naming
    ``op`` (the public function checked): a string or a float is never taken as a mask.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{op}: causal must be a bool, got {causal!r} ({type(causal).__name__})")
    if sliding_window is None:
        left, right = -1, -1
    else:
        if not (isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2):
            raise ValueError(
                f"{op}: sliding_window must be None or a pair (left, right), got {sliding_window!r}"
            )
        for name, w in zip(("left", "right"), sliding_window, strict=True):
            if w is not None and (
                isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer))
            ):
                raise TypeError(
                    f"{op}: sliding_window {name} must be an int, or None/-1 for unbounded; got "
                    f"{w!r} ({type(w).__name__})"
                )
        left, right = (-1 if w is None else int(w) for w in sliding_window)
        for name, w in (("left", left), ("right", right)):
            if w < -1:
                raise ValueError(
                    f"{op}: sliding_window {name} must be >= 0, or -1/None for unbounded, got {w}"
                )
    if causal:
        if right > 0:
            raise ValueError(
                f"{op}: causal=True allows no keys right of the diagonal, but sliding_window "
                f"right={right}"
            )
        right = 0
    left = -1 if left >= _MAX_WINDOW else left
    right = -1 if right >= _MAX_WINDOW else right
    return left, right


def _softmax_attend(s, visible, v, rows_axis_out):
    """Masked softmax of scores s [..., Sq, Sk] against v; returns (o, denom, lse) in float32.

    Keys a row cannot see contribute nothing, even where v holds NaN or inf (a plain P @ V
    would make the row NaN through 0 * NaN): P @ V runs on v's finite entries, and the
    non-finite ones are added back per row from the keys the row sees."""
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    finite = jnp.isfinite(v)
    o = jnp.einsum(
        rows_axis_out,
        p.astype(v.dtype),
        jnp.where(finite, v, 0),
        precision=_HI,
        preferred_element_type=v.dtype,
    )
    o = jax.lax.cond(
        jnp.all(finite), lambda o: o, partial(_add_nonfinite, p, visible, v, rows_axis_out), o
    )
    lse = jnp.where(denom > 0, jnp.log(jnp.where(denom > 0, denom, 1.0)) + m, -jnp.inf)
    return o, denom, lse[..., 0]


def _add_nonfinite(p, visible, v, rows_axis_out, o):
    """o with the non-finite v entries of the keys each row sees, as IEEE sums give them: NaN
    from a NaN, from +inf and -inf together, or from inf times a zero weight; else +-inf."""
    seen = jnp.broadcast_to(visible, p.shape)
    weighted = seen & (p > 0)

    def any_of(rows, entries):  # [..., Sq, Dv]: does a key in `rows` have an entry in `entries`
        n = jnp.einsum(
            rows_axis_out,
            rows.astype(jnp.float32),
            entries.astype(jnp.float32),
            precision=_HI,
            preferred_element_type=jnp.float32,
        )
        return n > 0

    pos, neg = any_of(weighted, v == jnp.inf), any_of(weighted, v == -jnp.inf)
    nan = any_of(seen, jnp.isnan(v)) | any_of(seen & ~weighted, jnp.isinf(v)) | (pos & neg)
    o = jnp.where(pos, jnp.inf, jnp.where(neg, -jnp.inf, o))
    return jnp.where(nan, jnp.nan, o).astype(o.dtype)


def _scores(q, k, scale, softcap):
    s = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=_HI, preferred_element_type=q.dtype)
    s = s * jnp.asarray(scale, q.dtype)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    return s


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window=None,
    logits_soft_cap: float | None = None,
    q_seqlens=None,
    kv_seqlens=None,
    return_lse: bool = False,
    compute_dtype=jnp.float32,
):
    """Dense reference: q [B,Sq,Hq,D], k [B,Skv,Hkv,D], v [B,Skv,Hkv,Dv] -> o [B,Sq,Hq,Dv]
    (+ lse [B,Hq,Sq] float32). Lengths are clipped to [0, S]; rows past q_seqlens are zero.

    ``compute_dtype`` other than float32 runs the whole computation (scores, softmax, P@V) in that
    dtype: the tests use it to measure the error a plain same-dtype jnp attention makes.

    Called outside any transformation, it runs as one jitted computation compiled without XLA's
    excess precision (`_jit_exact`)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left, right = normalize_window(causal, sliding_window)
    opts = dict(
        scale=scale,
        left=left,
        right=right,
        softcap=float(logits_soft_cap) if logits_soft_cap else 0.0,
        return_lse=bool(return_lse),
        compute_dtype=jnp.dtype(compute_dtype),
    )
    run = _attention_jit if _untraced(q, k, v, q_seqlens, kv_seqlens) else _attention
    return run(q, k, v, q_seqlens, kv_seqlens, **opts)


def _attention(q, k, v, q_seqlens, kv_seqlens, *, scale, left, right, softcap, return_lse,
               compute_dtype):  # fmt: skip
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qf = q.astype(compute_dtype)
    kf = jnp.repeat(k.astype(compute_dtype), g, axis=2)
    vf = jnp.repeat(v.astype(compute_dtype), g, axis=2)
    s = _scores(qf, kf, scale, softcap)  # [B, Hq, Sq, Skv]

    qlen = jnp.full((B,), Sq, jnp.int32) if q_seqlens is None else jnp.clip(q_seqlens, 0, Sq)
    klen = jnp.full((B,), Skv, jnp.int32) if kv_seqlens is None else jnp.clip(kv_seqlens, 0, Skv)
    i = jnp.arange(Sq)[None, :, None]
    j = jnp.arange(Skv)[None, None, :]
    diag = i + (klen - qlen)[:, None, None]
    visible = (i < qlen[:, None, None]) & (j < klen[:, None, None])
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    visible = visible[:, None]  # [B, 1, Sq, Skv]

    o, denom, lse = _softmax_attend(s, visible, vf, "bhqk,bkhd->bqhd")
    o = o / jnp.where(denom > 0, denom, 1.0).transpose(0, 2, 1, 3)
    o = o.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    return (o, lse) if return_lse else o


def _jit_exact(fn, static_argnames):
    """fn as one jitted computation that rounds every step to its dtype as op-by-op execution
    does (XLA's excess precision off: bit-identical to op by op but for tanh, which XLA's fused
    code computes within an ulp or two of the standalone op's; tests/test_flash_attention.py
    checks both), with one compile per shape instead of one per op (most of the time the tests
    spent in the reference on a CPU). Compiler options only apply to a top-level jit: inside a
    transformation the caller traces fn itself (`_untraced`)."""
    return jax.jit(
        fn, static_argnames=static_argnames, compiler_options={"xla_allow_excess_precision": False}
    )


def _untraced(*args) -> bool:
    """No argument is a tracer: the call is not inside jit, grad, vmap or another trace."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args))


_attention_jit = _jit_exact(
    _attention, ("scale", "left", "right", "softcap", "return_lse", "compute_dtype")
)


def attention_packed(
    q,
    k,
    v,
    q_starts,
    q_ends,
    k_starts,
    k_ends,
    *,
    softmax_scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    max_seqlen_q: int,
):
    """Packed reference with the kernels' exact semantics (cuda/include/jax_flash/flash_params.h):
    q [Tq,Hq,D], k [Tk,Hkv,D], v [Tk,Hkv,Dv], starts/ends [B] int32 (clamped like the kernels)
    -> (o [Tq,Hq,Dv] in q's dtype, lse [Hq,Tq] float32). Rows owned by no sequence are zero.
    Called outside any transformation, it runs as one jitted computation (`_jit_exact`)."""
    args = (q, k, v, q_starts, q_ends, k_starts, k_ends)
    run = _attention_packed_jit if _untraced(*args) else _attention_packed
    return run(
        *args,
        softmax_scale=float(softmax_scale),
        softcap=float(softcap),
        window_left=int(window_left),
        window_right=int(window_right),
        max_seqlen_q=int(max_seqlen_q),
    )


def _attention_packed(q, k, v, q_starts, q_ends, k_starts, k_ends, *, softmax_scale, softcap,
                      window_left, window_right, max_seqlen_q):  # fmt: skip
    Tq, Hq, _ = q.shape
    Tk, Hkv, _ = k.shape
    g = Hq // Hkv
    qs = jnp.clip(q_starts, 0, Tq)
    qlen = jnp.minimum(jnp.clip(q_ends, qs, Tq) - qs, max_seqlen_q)
    ks = jnp.clip(k_starts, 0, Tk)
    klen = jnp.clip(k_ends, ks, Tk) - ks
    r = jnp.arange(Tq)[None, :]
    c = jnp.arange(Tk)[None, :]
    i = (r - qs[:, None])[:, :, None]  # [B, Tq, 1]
    j = (c - ks[:, None])[:, None, :]  # [B, 1, Tk]
    in_q = (i >= 0) & (i < qlen[:, None, None])
    in_k = (j >= 0) & (j < klen[:, None, None])
    diag = i + (klen - qlen)[:, None, None]
    visible = in_q & in_k
    if window_left >= 0:
        visible &= j >= diag - window_left
    if window_right >= 0:
        visible &= j <= diag + window_right
    visible = jnp.any(visible, axis=0)[None]  # [1, Tq, Tk]

    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), g, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=1)
    s = _scores(qf, kf, softmax_scale, softcap)  # [Hq, Tq, Tk]
    o, denom, lse = _softmax_attend(s, visible, vf, "hqk,khd->qhd")
    o = o / jnp.where(denom > 0, denom, 1.0).transpose(1, 0, 2)
    return o.astype(q.dtype), lse


_attention_packed_jit = _jit_exact(
    _attention_packed, ("softmax_scale", "softcap", "window_left", "window_right", "max_seqlen_q")
)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window=None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
):
    """Varlen reference: packed q [Tq,Hq,D], k [Tk,Hkv,D], v [Tk,Hkv,Dv], cu_seqlens [B+1]
    -> o [Tq,Hq,Dv] (+ lse [Hq,Tq] float32)."""
    left, right = normalize_window(causal, sliding_window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    o, lse = attention_packed(
        q,
        k,
        v,
        cu_seqlens_q[:-1],
        cu_seqlens_q[1:],
        cu_seqlens_k[:-1],
        cu_seqlens_k[1:],
        softmax_scale=scale,
        softcap=float(logits_soft_cap or 0.0),
        window_left=left,
        window_right=right,
        max_seqlen_q=q.shape[0],
    )
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# Paged KV cache (layout and rules: cuda/include/jax_flash/paged_params.h)

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _divide(x, y):
    """x / y as the kernels divide (IEEE, per element): the barrier keeps XLA from turning a
    division by a broadcast value into a product with its reciprocal, which rounds differently."""
    return x / jax.lax.optimization_barrier(
        jnp.broadcast_to(y, jnp.broadcast_shapes(x.shape, y.shape))
    )


def quantize(x, scale, cache_dtype):
    """x / scale (float32, IEEE division) clamped to +-qmax, rounded (half to even) to the cache
    dtype; scale 0 stores zeros. `scale` broadcasts against x."""
    name = jnp.dtype(cache_dtype).name
    qmax = QMAX[name]
    x = x.astype(jnp.float32)
    scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), x.shape)
    y = jnp.where(scale == 0, 0.0, _divide(x, jnp.where(scale == 0, 1.0, scale)))
    y = jnp.clip(y, -qmax, qmax)
    if name == "int8":
        y = jnp.round(y)
    return y.astype(cache_dtype)


def per_token_scale(x, cache_dtype):
    """amax over the last axis / qmax, float32 (the per-token-and-head scale of append_kv)."""
    qmax = QMAX[jnp.dtype(cache_dtype).name]
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    return _divide(amax, jnp.float32(qmax))


def gather_pages(pages, block_tables, scale=None):
    """Dense [B, max_pages * page_size, H, D] float32 copy of a paged cache (ids clipped into
    range; validity is checked separately), dequantised with a per-head [H] or per-token
    [num_pages, page_size, H] scale."""
    num_pages, page_size = pages.shape[:2]
    ids = jnp.clip(block_tables, 0, num_pages - 1)
    x = pages[ids].astype(jnp.float32)  # [B, max_pages, page_size, H, D]
    if scale is not None:
        s = scale[:, None] if scale.ndim == 1 else scale[ids][..., None]
        x = x * s
    B, mp = block_tables.shape
    return x.reshape(B, mp * page_size, *pages.shape[2:])


def paged_sequence_valid(block_tables, kv_lens, num_pages, page_size):
    """[B] bool: kv_len in [0, capacity] and every page id it uses in [0, num_pages)."""
    max_pages = block_tables.shape[1]
    used = jnp.arange(max_pages)[None, :] < ((kv_lens + page_size - 1) // page_size)[:, None]
    ids_ok = jnp.all(~used | ((block_tables >= 0) & (block_tables < num_pages)), axis=1)
    return ids_ok & (kv_lens >= 0) & (kv_lens <= max_pages * page_size)


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    *,
    k_scale=None,
    v_scale=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window=None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
):
    """Gather the pages into a dense cache and attend: q [B,Hq,D] or [B,Sq,Hq,D] -> o like q
    (+ lse [B,Hq] or [B,Hq,Sq]). Sequences with bad data (see paged_params.h) give NaN."""
    single = q.ndim == 3
    q4 = q[:, None] if single else q
    page_size, num_pages = k_pages.shape[1], k_pages.shape[0]
    k = gather_pages(k_pages, block_tables, k_scale)
    v = gather_pages(v_pages, block_tables, v_scale)
    o, lse = attention(
        q4.astype(jnp.float32),
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        kv_seqlens=kv_lens,
        return_lse=True,
    )
    ok = paged_sequence_valid(block_tables, kv_lens, num_pages, page_size)
    o = jnp.where(ok[:, None, None, None], o, jnp.nan).astype(q.dtype)
    lse = jnp.where(ok[:, None, None], lse, jnp.nan)
    if single:
        o, lse = o[:, 0], lse[..., 0]
    return (o, lse) if return_lse else o


def append_kv(k_pages, v_pages, k_new, v_new, slot_mapping, *, k_scale=None, v_scale=None):
    """Scatter k_new/v_new [T,H,D] into the pages at slot_mapping [T] (out-of-range slots are
    skipped), quantising for int8/e4m3 caches. Returns the updated (k_pages, v_pages, k_scale,
    v_scale); per-token scales are updated, per-head ones returned as given."""
    num_pages, page_size = k_pages.shape[:2]
    n_slots = num_pages * page_size
    ok = (slot_mapping >= 0) & (slot_mapping < n_slots)
    slot = jnp.where(ok, slot_mapping, n_slots)  # out of range -> dropped by the scatter

    def write(pages, new, scale):
        flat = pages.reshape(n_slots, *pages.shape[2:])
        if scale is None:
            vals = new.astype(pages.dtype)
        elif scale.ndim == 1:
            vals = quantize(new, scale[:, None], pages.dtype)
        else:
            tok_scale = per_token_scale(new, pages.dtype)  # [T, H]
            vals = quantize(new, tok_scale[..., None], pages.dtype)
            flat_s = scale.reshape(n_slots, -1).at[slot].set(tok_scale, mode="drop")
            scale = flat_s.reshape(scale.shape)
        flat = flat.at[slot].set(vals, mode="drop")
        return flat.reshape(pages.shape), scale

    k_pages, k_scale = write(k_pages, k_new, k_scale)
    v_pages, v_scale = write(v_pages, v_new, v_scale)
    return k_pages, v_pages, k_scale, v_scale


def copy_pages(k_pages, v_pages, src, dst, *, k_scale=None, v_scale=None):
    """Copy pages src[i] -> dst[i] (pairs with an id out of range are skipped)."""
    num_pages = k_pages.shape[0]
    ok = (src >= 0) & (src < num_pages) & (dst >= 0) & (dst < num_pages)
    s = jnp.clip(src, 0, num_pages - 1)
    d = jnp.where(ok, dst, num_pages)

    def cp(x):
        return None if x is None or x.ndim == 1 else x.at[d].set(x[s], mode="drop")

    k_scale = k_scale if k_scale is None or k_scale.ndim == 1 else cp(k_scale)
    v_scale = v_scale if v_scale is None or v_scale.ndim == 1 else cp(v_scale)
    return cp(k_pages), cp(v_pages), k_scale, v_scale


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies ``[rotary_dim // 2]`` float32 of RoPE, computed on the host.

    ``theta ** -(2i / rotary_dim)``, then the frequency scaling, step by step in float32 as
    Hugging Face transformers' ``modeling_rope_utils`` computes them (so that a checkpoint's
    rotations match): ``scaling`` None / ``{"type": "default"}``; ``{"type": "linear",
    "factor"}`` (``inv_freq / factor``, i.e. positions / factor); ``{"type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` as
    ``_compute_llama3_parameters``. ``"rope_type"`` may replace ``"type"``. Inputs are assumed
    valid (:func:`jax_flash.apply_rope` checks them).
    """
    f32 = np.float32
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(f32) / f32(rotary_dim)
    inv_freq = f32(1.0) / np.power(f32(theta), exponents)
    kind = "default" if scaling is None else scaling.get("type", scaling.get("rope_type"))
    if kind == "linear":
        return inv_freq / f32(scaling["factor"])
    if kind == "llama3":
        factor = f32(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = f32(old_len / low), f32(old_len / high)
        wavelen = f32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (f32(old_len) / wavelen - f32(low)) / f32(high - low)
        smoothed = (f32(1.0) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(f32)
    return inv_freq


def apply_rope(x, positions, inv_freq, *, style: str = "neox", rotary_dim: int | None = None):
    """Rotary embedding of ``x [..., S, H, D]`` at ``positions [..., S]`` (broadcast against the
    leading dims of x) with ``inv_freq [rotary_dim // 2]``; see cuda/include/jax_flash/
    rope_params.h. Angles ``float32(pos) * inv_freq`` and the rotation in float32, output in
    x's dtype."""
    D = x.shape[-1]
    rotary_dim = D if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    angle = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # [..., S, 1, half]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    if style == "neox":
        a, b = rot[..., :half], rot[..., half:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([out, rest], axis=-1).astype(x.dtype)


def append_kv_rope(
    k_pages, v_pages, k_new, v_new, slot_mapping, positions, inv_freq, *, style="neox",
    rotary_dim=None, q=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """append_kv with RoPE fused in (cuda/include/jax_flash/kv_cache_rope_params.h): by
    definition :func:`apply_rope` of k_new (and q) at positions [T], then :func:`append_kv` of
    the rotated keys. Returns ``(q_rot or None, k_pages, v_pages, k_scale, v_scale)``."""
    rope = dict(style=style, rotary_dim=rotary_dim)
    k_rot = apply_rope(k_new, positions, inv_freq, **rope)
    q_rot = None if q is None else apply_rope(q, positions, inv_freq, **rope)
    out = append_kv(k_pages, v_pages, k_rot, v_new, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return (q_rot, *out)


def split_qkv(qkv):
    """The queries ``[T, Hkv * G, D]``, keys and values ``[T, Hkv, D]`` of packed rows ``qkv
    [T, Hkv, G + 2, D]`` (per kv head: its G query heads, then its key, then its value; the
    layout :func:`jax_flash.append_qkv` reads)."""
    T, Hkv, G2, D = qkv.shape
    return qkv[:, :, : G2 - 2].reshape(T, Hkv * (G2 - 2), D), qkv[:, :, -2], qkv[:, :, -1]


# ---------------------------------------------------------------------------------------------
# Sampling (semantics: cuda/include/jax_flash/sampling_params.h)

_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)


def _mul_hi_lo(a: int, b):
    """High and low words of the 64-bit product of the constant a and uint32 b (16-bit limbs)."""
    u32 = jnp.uint32
    a_lo, a_hi = u32(a & 0xFFFF), u32(a >> 16)
    b_lo, b_hi = b & u32(0xFFFF), b >> u32(16)
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (ll >> u32(16)) + (lh & u32(0xFFFF)) + (hl & u32(0xFFFF))
    hi = hh + (lh >> u32(16)) + (hl >> u32(16)) + (mid >> u32(16))
    return hi, u32(a) * b


def philox4x32_10(counter, key):
    """Philox4x32-10 words of ``counter [..., 4]`` uint32 under ``key [..., 2]`` uint32."""
    u32 = jnp.uint32
    c = [counter[..., i] for i in range(4)]
    k0, k1 = key[..., 0], key[..., 1]
    for r in range(10):
        if r > 0:
            k0, k1 = k0 + u32(_PHILOX_WEYL[0]), k1 + u32(_PHILOX_WEYL[1])
        hi0, lo0 = _mul_hi_lo(_PHILOX_MUL[0], c[0])
        hi1, lo1 = _mul_hi_lo(_PHILOX_MUL[1], c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return jnp.stack(c, axis=-1)


def sampling_seeds(key, batch: int):
    """Per-row seeds ``[batch, 3]`` uint32 of one sampling call: the Philox key (two words drawn
    from the JAX key with ``jax.random.bits``) and the row index as the row's stream."""
    words = jax.random.bits(key, (2,), jnp.uint32)
    rows = jnp.arange(batch, dtype=jnp.uint32)[:, None]
    return jnp.concatenate([jnp.broadcast_to(words, (batch, 2)), rows], axis=1)


def sampling_uniforms(seeds, vocab: int):
    """The uniforms ``u [B, vocab]`` in (0, 1) of every token: word ``i % 4`` of Philox at
    counter ``(i // 4, stream, 0, 0)``, as ``(2 * (w >> 9) + 1) / 2^24``."""
    B = seeds.shape[0]
    groups = -(-vocab // 4)
    g = jnp.broadcast_to(jnp.arange(groups, dtype=jnp.uint32), (B, groups))
    zero = jnp.zeros_like(g)
    counter = jnp.stack([g, jnp.broadcast_to(seeds[:, 2:3], g.shape), zero, zero], axis=-1)
    words = philox4x32_10(counter, seeds[:, None, :2]).reshape(B, 4 * groups)[:, :vocab]
    odd = ((words >> jnp.uint32(9)) << jnp.uint32(1)) | jnp.uint32(1)
    return odd.astype(jnp.float32) * jnp.float32(2.0**-24)


def _normalize_logits(logits):
    x = logits.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    x = jnp.where(x == jnp.inf, jnp.float32(float.fromhex("0x1.fep127")), x)  # the largest bfloat16
    return jnp.where(x == 0, 0.0, x)


def _sampling_plan(logits, temperature, top_k, top_p, min_p):
    """(x, d, kept, greedy, top, valid) of every row, sorting the vocabulary."""
    B, V = logits.shape
    x = _normalize_logits(logits)
    order = jnp.argsort(-x, axis=-1, stable=True)  # x descending, index ascending on ties
    xs = jnp.take_along_axis(x, order, axis=-1)
    x_max = xs[:, :1]
    tau = temperature.astype(jnp.float32)[:, None]
    greedy = ~(tau > 0)
    d = _divide(x - x_max, jnp.where(greedy, 1.0, tau))
    ds = _divide(xs - x_max, jnp.where(greedy, 1.0, tau))
    rank = jnp.arange(V)[None, :]
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)[:, None]
    cum = jnp.cumsum(jnp.where(rank < k, jnp.exp(ds), 0.0), axis=-1)
    n_p = jnp.sum(cum < top_p[:, None] * cum[:, -1:], axis=-1, keepdims=True) + 1
    n_p = jnp.where(top_p[:, None] < 1, n_p, V)
    log_min_p = jnp.where(min_p > 0, jnp.log(jnp.minimum(min_p, 1.0)), -jnp.inf)
    n_m = jnp.sum(ds >= log_min_p[:, None], axis=-1, keepdims=True)
    n = jnp.maximum(jnp.minimum(jnp.minimum(k, n_p), n_m), 1)
    n = jnp.where(greedy, 1, n)
    valid = x_max > -jnp.inf
    kept_sorted = (rank < n) & valid
    kept = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order].set(kept_sorted)
    return x, d, kept, greedy, order[:, :1], valid


def top_k_top_p_filter(logits, temperature, top_k, top_p, min_p):
    """Masked logits ``[B, V]`` (logits' dtype): ``logits / temperature`` where kept, -inf
    elsewhere (the logit itself for a greedy row). Parameters are per-row ``[B]`` arrays.

    Sorts the vocabulary and sums probabilities in float32, where the kernels sum fixed-point
    masses exactly: the kept sets agree except when a top-p boundary lies within float32
    rounding of the target."""
    _, _, kept, greedy, _, _ = _sampling_plan(logits, temperature, top_k, top_p, min_p)
    raw = logits.astype(jnp.float32)
    tau = temperature.astype(jnp.float32)[:, None]
    y = jnp.where(greedy, raw, _divide(raw, jnp.where(greedy, 1.0, tau)))
    return jnp.where(kept, y, -jnp.inf).astype(logits.dtype)


def sample(logits, seeds, temperature, top_k, top_p, min_p):
    """Tokens ``[B]`` int32 drawn by the Gumbel-max trick with the kernels' uniforms, so that
    the tokens equal the kernels' unless a kept set or a near-tie of scores differs by rounding;
    -1 for rows with no finite logit. Parameters are per-row ``[B]`` arrays, ``seeds`` as
    :func:`sampling_seeds`."""
    x, d, kept, greedy, top, valid = _sampling_plan(logits, temperature, top_k, top_p, min_p)
    u = sampling_uniforms(seeds, logits.shape[1])
    score = jnp.where(kept, d - jnp.log(-jnp.log(u)), -jnp.inf)
    token = jnp.where(greedy, top, jnp.argmax(score, axis=-1, keepdims=True))
    return jnp.where(valid, token, -1)[:, 0].astype(jnp.int32)
