"""Writing the paged KV cache in place: `append_kv` (and `append_qkv`, its fused-RoPE form
reading packed q/k/v rows), `copy_pages`, `reorder_beams`, plus the
slot arithmetic and a `checkify` debug check of block tables and lengths."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from .. import reference
from ..primitives.kv_cache import (
    CacheConfig,
    RopeCacheConfig,
    append_kv_p,
    append_kv_rope_p,
    append_qkv_rope_p,
    copy_pages_p,
)
from ..primitives.rope import MAX_ROTARY_DIM
from . import _checks
from .paged_attention import check_cache
from .rope import rope_options

ROPE_KEYS = ("style", "rotary_dim", "theta", "scaling")


def _bind(p, op, k_pages, v_pages, k_scale, v_scale, extra, implementation):
    mode = check_cache(op, k_pages, v_pages, k_scale, v_scale)
    _checks.implementation(op, implementation)
    quantized = k_scale is not None
    empty = jnp.zeros((0,), jnp.float32)
    ks = k_scale if quantized else empty
    vs = v_scale if quantized else empty
    if implementation == "xla":
        fn = reference.append_kv if p is append_kv_p else reference.copy_pages
        out = fn(k_pages, v_pages, *extra, k_scale=k_scale, v_scale=v_scale)
    else:
        out = p.bind(k_pages, v_pages, ks, vs, *extra, config=CacheConfig(mode, implementation))
    return tuple(out) if quantized else tuple(out[:2])


def append_kv(
    k_pages,
    v_pages,
    k_new,
    v_new,
    slot_mapping,
    *,
    k_scale=None,
    v_scale=None,
    positions=None,
    rope: dict | None = None,
    q=None,
    implementation: str | None = None,
):
    """Write new keys and values into a paged cache, in place; optionally rotate the keys (and
    queries) by RoPE in the same kernel first.

    Parameters
    ----------
    k_pages, v_pages : ``[num_pages, page_size, Hkv, D]`` / ``[..., Dv]``, the new rows' dtype or
        int8 / float8_e4m3fn (quantized: ``k_scale``/``v_scale`` float32 ``[Hkv]`` are read,
        ``[num_pages, page_size, Hkv]`` are written per token as ``amax / qmax``).
    k_new, v_new : ``[T, Hkv, D]`` / ``[T, Hkv, Dv]`` float32, float16 or bfloat16.
    slot_mapping : int32 ``[T]``: row ``t`` goes to page ``slot // page_size`` at offset
        ``slot % page_size``. Slots that are negative or ``>= num_pages * page_size`` are skipped
        (use -1 for padding rows).
    positions : int ``[T]``, optional
        Fused RoPE: each new token's position (any values, as :func:`jax_flash.apply_rope`).
        Needs ``rope``.
    rope : dict or None
        Fused RoPE: :func:`jax_flash.apply_rope`'s options ``style``, ``rotary_dim``, ``theta``,
        ``scaling`` (any subset; ``{}`` = its defaults). With ``positions`` and ``rope`` the
        keys written are ``apply_rope(k_new, positions, **rope)``, rotated in the cache-write
        kernel itself (the rotated keys never go through memory outside the cache), with the
        same bits as ``apply_rope`` followed by ``append_kv`` on every platform, quantized
        caches included.
    q : ``[T, Hq, D]`` (k_new's dtype, ``Hq % Hkv == 0``), optional
        Fused RoPE: queries rotated in the same kernel, returned first; every row is rotated,
        skipped slots included.

    Returns
    -------
    ``(k_pages, v_pages)``, or ``(k_pages, v_pages, k_scale, v_scale)`` for a quantized cache;
    with ``q`` given, ``apply_rope(q, positions, **rope)`` comes first: ``(q_rot, k_pages,
    v_pages[, k_scale, v_scale])``. The FFI call aliases each cache input to its output: under
    ``jax.jit`` with the cache arguments donated (``donate_argnums``) XLA updates the cache
    where it lies, with no copy.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> k_pages = v_pages = jnp.zeros((8, 16, 2, 64), jnp.float16)
    >>> k_new = v_new = jnp.ones((3, 2, 64), jnp.float16)
    >>> write = jax.jit(jax_flash.append_kv, donate_argnums=(0, 1))
    >>> k_pages, v_pages = write(k_pages, v_pages + 0, k_new, v_new, jnp.array([0, 1, 40]))
    >>> float(k_pages[2, 8, 0, 0])  # slot 40 = page 2, offset 8
    1.0

    Fused RoPE (a decode step: q and k rotated, k written, in one kernel):

    >>> q = jnp.ones((3, 4, 64), jnp.float16)
    >>> q_rot, k_pages, v_pages = jax_flash.append_kv(
    ...     k_pages, v_pages, k_new, v_new, jnp.array([0, 1, 40]),
    ...     positions=jnp.array([7, 8, 9]), rope={"theta": 500000.0}, q=q)
    >>> bool((q_rot == jax_flash.apply_rope(q, jnp.array([7, 8, 9]), theta=500000.0)).all())
    True
    """
    op = "append_kv"
    _checks.array_arg(op, "k_new", k_new, 3, "[T, Hkv, D]")
    _checks.array_arg(op, "v_new", v_new, 3, "[T, Hkv, Dv]")
    _checks.float_dtype(op, "k_new", k_new)
    _checks.float_dtype(op, "v_new", v_new, like=k_new)
    T, Hkv = k_new.shape[:2]
    if v_new.shape[:2] != (T, Hkv):
        raise ValueError(f"{op}: v_new {tuple(v_new.shape)} does not match k_new {k_new.shape}")
    check_cache(op, k_pages, v_pages, k_scale, v_scale, head_dim=k_new.shape[2], dtype=k_new.dtype)
    if k_pages.shape[2] != Hkv or v_pages.shape[3] != v_new.shape[2]:
        raise ValueError(
            f"{op}: new rows [T, Hkv, D]/[T, Hkv, Dv] = {tuple(k_new.shape)}/{tuple(v_new.shape)} "
            f"do not match the pages {tuple(k_pages.shape)}/{tuple(v_pages.shape)}"
        )
    slot_mapping = _checks.int_vector(op, "slot_mapping", slot_mapping, T)
    if positions is None and rope is None:
        if q is not None:
            raise ValueError(
                f"{op}: q is only taken with the fused RoPE; pass positions= and rope= too "
                "(rope={} for apply_rope's defaults)"
            )
        return _bind(
            append_kv_p, op, k_pages, v_pages, k_scale, v_scale,
            (k_new, v_new, slot_mapping), implementation,
        )  # fmt: skip
    return _append_rope(
        op, k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale, positions, rope, q,
        implementation,
    )  # fmt: skip


def _rope_config(op, positions, rope, T, D, where):
    """The fused RoPE's checks: positions [T] as int32, and (style, rotary_dim, inv_freq) of
    the ``rope`` dict for rows of D features (``where`` names them in messages)."""
    if rope is None:
        raise ValueError(
            f"{op}: positions is given but rope is None; pass rope= (a dict of apply_rope's "
            "options, {} for its defaults) to rotate the keys, or drop positions"
        )
    if positions is None:
        raise ValueError(f"{op}: rope is given but positions is None; pass positions [T] (int)")
    if not isinstance(rope, Mapping):
        raise TypeError(
            f"{op}: rope must be a dict of apply_rope's options {list(ROPE_KEYS)}, got "
            f"{type(rope).__name__}"
        )
    unknown = sorted(set(rope) - set(ROPE_KEYS))
    if unknown:
        raise ValueError(
            f"{op}: rope has unknown keys {unknown}; apply_rope's options are {list(ROPE_KEYS)}"
        )
    positions = _checks.int_vector(op, "positions", positions, T)
    style = rope.get("style", "neox")
    rd, inv_freq = rope_options(
        op, D, style=style, rotary_dim=rope.get("rotary_dim"),
        theta=rope.get("theta", 10000.0), scaling=rope.get("scaling"),
        key=lambda name: f"rope[{name!r}]", where=where,
    )  # fmt: skip
    return positions, style, rd, inv_freq


def _rope_bind_config(op, mode, style, rd, inv_freq, implementation):
    """The primitives' static config of the fused RoPE (the native kernels' limit checked)."""
    if rd > MAX_ROTARY_DIM:
        raise ValueError(
            f"{op}: the native kernels take rope['rotary_dim'] up to {MAX_ROTARY_DIM}, got {rd}; "
            "use implementation='xla'"
        )
    return RopeCacheConfig(
        mode, style, rd, tuple(float(v) for v in np.asarray(inv_freq)), implementation
    )


def _scale_operands(k_scale, v_scale):
    empty = jnp.zeros((0,), jnp.float32)
    return (empty, empty) if k_scale is None else (k_scale, v_scale)


def _append_rope(
    op, k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale, positions, rope, q,
    implementation,
):  # fmt: skip
    """append_kv with the fused RoPE: checks, then the primitive or the jnp reference."""
    T, Hkv, D = k_new.shape
    positions, style, rd, inv_freq = _rope_config(
        op, positions, rope, T, D, f"k_new {tuple(k_new.shape)}"
    )
    if q is not None:
        _checks.array_arg(op, "q", q, 3, "[T, Hq, D]")
        if q.dtype != k_new.dtype:
            raise TypeError(f"{op}: q has dtype {q.dtype}, expected k_new's {k_new.dtype}")
        if q.shape[0] != T or q.shape[2] != D:
            raise ValueError(
                f"{op}: q must have shape [T, Hq, D] = [{T}, Hq, {D}] (k_new {tuple(k_new.shape)}),"
                f" got {tuple(q.shape)}"
            )
        _checks.heads(op, q.shape[1], Hkv)
    mode = check_cache(op, k_pages, v_pages, k_scale, v_scale)
    _checks.implementation(op, implementation)
    quantized = k_scale is not None
    if implementation == "xla":
        q_rot, *caches = reference.append_kv_rope(
            k_pages, v_pages, k_new, v_new, slot_mapping, positions, inv_freq, style=style,
            rotary_dim=rd, q=q, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    else:
        config = _rope_bind_config(op, mode, style, rd, inv_freq, implementation)
        q_in = jnp.zeros((T, 0, D), k_new.dtype) if q is None else q
        *caches, q_rot = append_kv_rope_p.bind(
            k_pages, v_pages, *_scale_operands(k_scale, v_scale), k_new, v_new, slot_mapping,
            positions, q_in, config=config,
        )  # fmt: skip
    caches = tuple(caches) if quantized else tuple(caches[:2])
    return caches if q is None else (q_rot, *caches)


def append_qkv(
    k_pages, v_pages, qkv, slot_mapping, positions, *, rope, k_scale=None, v_scale=None,
    implementation: str | None = None,
):  # fmt: skip
    """:func:`append_kv` with the fused RoPE and ``q``, reading the queries, keys and values
    from one packed array: a fused q/k/v projection's output goes in as it is, with no copies
    to slice it apart first.

    Parameters
    ----------
    k_pages, v_pages, k_scale, v_scale, slot_mapping, positions, rope, implementation
        As :func:`append_kv` (``D == Dv``).
    qkv : ``[T, Hkv, G + 2, D]`` float32, float16 or bfloat16, ``G >= 1``: per token and kv head
        ``h``, its ``G`` query heads ``h * G .. h * G + G - 1``, then its key, then its value
        (the layout of :class:`jax_flash.nn.Attention`'s fused projection).

    Returns
    -------
    ``(q_rot, k_pages, v_pages[, k_scale, v_scale])`` with ``q_rot`` ``[T, Hkv * G, D]``: the
    same bits as :func:`append_kv` with ``k_new = qkv[:, :, G]``, ``v_new = qkv[:, :, G + 1]``
    and ``q = qkv[:, :, :G].reshape(T, Hkv * G, D)``, on every platform.

    Examples
    --------
    >>> import jax.numpy as jnp, jax_flash
    >>> k_pages = v_pages = jnp.zeros((8, 16, 2, 64), jnp.float16)
    >>> qkv = jnp.ones((3, 2, 4 + 2, 64), jnp.float16)  # 3 tokens, 2 kv heads, 4 queries each
    >>> q_rot, k_pages, v_pages = jax_flash.append_qkv(
    ...     k_pages, v_pages, qkv, jnp.array([0, 1, 40]), jnp.array([7, 8, 9]), rope={})
    >>> q_rot.shape
    (3, 8, 64)
    """
    op = "append_qkv"
    _checks.array_arg(op, "qkv", qkv, 4, "[T, Hkv, G + 2, D]")
    _checks.float_dtype(op, "qkv", qkv)
    T, Hkv, G2, D = qkv.shape
    if G2 < 3:
        raise ValueError(
            f"{op}: qkv [T, Hkv, G + 2, D] needs at least one query head per kv head (G >= 1), "
            f"got shape {tuple(qkv.shape)}"
        )
    mode = check_cache(op, k_pages, v_pages, k_scale, v_scale, head_dim=D, dtype=qkv.dtype)
    if k_pages.shape[2] != Hkv or v_pages.shape[3] != D:
        raise ValueError(
            f"{op}: qkv [T, Hkv, G + 2, D] = {tuple(qkv.shape)} does not match the pages "
            f"{tuple(k_pages.shape)}/{tuple(v_pages.shape)} (packed rows need D == Dv)"
        )
    slot_mapping = _checks.int_vector(op, "slot_mapping", slot_mapping, T)
    positions, style, rd, inv_freq = _rope_config(
        op, positions, rope, T, D, f"qkv {tuple(qkv.shape)}"
    )
    _checks.implementation(op, implementation)
    if implementation == "xla":
        q, k_new, v_new = reference.split_qkv(qkv)
        return _append_rope(
            op, k_pages, v_pages, k_new, v_new, slot_mapping, k_scale, v_scale, positions, rope,
            q, implementation,
        )  # fmt: skip
    config = _rope_bind_config(op, mode, style, rd, inv_freq, implementation)
    *caches, q_rot = append_qkv_rope_p.bind(
        k_pages, v_pages, *_scale_operands(k_scale, v_scale), qkv, slot_mapping, positions,
        config=config,
    )  # fmt: skip
    caches = tuple(caches) if k_scale is not None else tuple(caches[:2])
    return (q_rot, *caches)


def copy_pages(k_pages, v_pages, src, dst, *, k_scale=None, v_scale=None, implementation=None):
    """Copy whole pages ``src[i] -> dst[i]`` of both caches (and per-token scales), in place.

    Destinations must be distinct and must not be sources; pairs with an id outside
    ``[0, num_pages)`` are skipped. Returns like :func:`append_kv`."""
    op = "copy_pages"
    src = jnp.asarray(src)
    if not hasattr(src, "ndim") or src.ndim != 1:
        raise ValueError(f"{op}: src must have shape (N,), got {getattr(src, 'shape', None)}")
    src = _checks.int_vector(op, "src", src, src.shape[0])
    dst = _checks.int_vector(op, "dst", dst, src.shape[0])
    return _bind(copy_pages_p, op, k_pages, v_pages, k_scale, v_scale, (src, dst), implementation)


def slot_mapping(block_tables, positions, page_size: int, valid=None):
    """Slots of cache positions: ``block_tables[b, pos // page_size] * page_size + pos %
    page_size`` for positions ``[B, S]`` (or ``[B]``); -1 where ``valid`` is False or the
    position lies past the block table.

    Parameters
    ----------
    block_tables : int ``[B, max_pages]``.
    positions : int ``[B]`` or ``[B, S]``: cache positions (row ``b`` of the block table maps
        row ``b`` of the positions). Negative positions give -1.
    page_size : int >= 1 (static), the cache's tokens per page.
    valid : bool ``[B]`` or the shape of positions, optional: False gives -1 (not written by
        :func:`append_kv`).

    Returns
    -------
    int32 slots of the shape of ``positions``.

    Examples
    --------
    >>> import jax.numpy as jnp, jax_flash
    >>> bt = jnp.array([[3, 5], [4, 6]], jnp.int32)
    >>> jax_flash.slot_mapping(bt, jnp.array([[0, 17], [2, 40]]), 16).tolist()
    [[48, 81], [66, -1]]
    """
    op = "slot_mapping"
    _checks.array_arg(op, "block_tables", block_tables, 2, "[B, max_pages]")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise TypeError(f"{op}: block_tables must be an integer array, got {block_tables.dtype}")
    page_size = _checks.static_int(op, "page_size", page_size, minimum=1)
    B, max_pages = block_tables.shape
    positions = positions if hasattr(positions, "dtype") else np.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"{op}: positions must be an integer array, got dtype {positions.dtype}")
    if positions.ndim not in (1, 2) or positions.shape[0] != B:
        raise ValueError(
            f"{op}: positions must have shape [B] or [B, S] with B = {B} (block_tables "
            f"{tuple(block_tables.shape)}), got {tuple(positions.shape)}"
        )
    positions = jnp.asarray(positions, jnp.int32)
    squeeze = positions.ndim == 1
    pos = positions[:, None] if squeeze else positions
    col = pos // page_size
    in_table = (pos >= 0) & (col < max_pages)
    page = jnp.take_along_axis(
        block_tables.astype(jnp.int32), jnp.clip(col, 0, max_pages - 1), axis=1
    )
    slots = jnp.where(in_table, page * page_size + pos % page_size, -1)
    if valid is not None:
        valid = valid if hasattr(valid, "dtype") else np.asarray(valid)
        if valid.dtype != bool or tuple(valid.shape) not in ((B,), tuple(positions.shape)):
            raise ValueError(
                f"{op}: valid must be a bool array of shape ({B},) or {tuple(positions.shape)} "
                f"(positions), got {valid.dtype} {tuple(valid.shape)}"
            )
        slots = jnp.where(jnp.asarray(valid).reshape(B, -1), slots, -1)
    return slots[:, 0] if squeeze else slots


def reorder_beams(
    block_tables, kv_lens, beam_ids, spare_pages, k_pages, v_pages, *, k_scale=None,
    v_scale=None, page_size=None, implementation=None,
):  # fmt: skip
    """Reorder beams through the paged cache with copy-on-write of the partially filled page.

    New beam ``i`` continues beam ``beam_ids[i]``: it takes that beam's block-table row and
    length, sharing its full pages (never written again); the partially filled last page, which
    the new beam will append to, is copied into ``spare_pages[i]`` (a free page reserved for
    beam ``i``) by :func:`copy_pages`. The old beams' partial last pages are free afterwards and
    become the new spares. All beams of a request must have the same length (as in beam search).

    Parameters
    ----------
    block_tables : int32 ``[N, max_pages]``; kv_lens : int32 ``[N]``; beam_ids : int ``[N]``
        (row index of each new beam's parent); spare_pages : int32 ``[N]`` distinct free pages.
    page_size : None (the cache's, ``k_pages.shape[1]``), or that same value; anything else
        raises a ValueError.

    Returns
    -------
    ``(block_tables, kv_lens, spare_pages, caches)`` where ``caches`` is the tuple returned by
    :func:`copy_pages`. Jittable; donate the caches to reorder in place.

    Examples
    --------
    >>> import jax.numpy as jnp, jax_flash
    >>> kp = vp = jnp.zeros((8, 4, 1, 64), jnp.float32)
    >>> bt = jnp.array([[0, 1], [2, 3]], jnp.int32)        # two beams, 6 tokens each
    >>> lens = jnp.array([6, 6], jnp.int32)
    >>> bt, lens, spare, (kp, vp) = jax_flash.reorder_beams(
    ...     bt, lens, jnp.array([0, 0]), jnp.array([6, 7], jnp.int32), kp, vp)
    >>> bt.tolist()   # both continue beam 0: page 0 shared, page 1 copied to 6 and 7
    [[0, 6], [0, 7]]
    >>> spare.tolist()  # the old partial pages 1 and 3 are free now
    [1, 3]
    """
    op = "reorder_beams"
    check_cache(op, k_pages, v_pages, k_scale, v_scale)
    if page_size is not None:
        # The pages' own size decides which page is partial; any other value would share a
        # page that a beam writes, or hand back a live page as a spare.
        given = _checks.static_int(op, "page_size", page_size, minimum=1)
        if given != k_pages.shape[1]:
            raise ValueError(
                f"{op}: page_size={given} does not match the cache's page size "
                f"{k_pages.shape[1]} (k_pages {tuple(k_pages.shape)}); leave it None"
            )
    page_size = k_pages.shape[1]
    _checks.array_arg(op, "block_tables", block_tables, 2, "[N, max_pages]")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise TypeError(f"{op}: block_tables must be an integer array, got {block_tables.dtype}")
    N = block_tables.shape[0]
    beam_ids = _checks.int_vector(op, "beam_ids", beam_ids, N)
    spare_pages = _checks.int_vector(op, "spare_pages", spare_pages, N)
    kv_lens = _checks.int_vector(op, "kv_lens", kv_lens, N)
    parent = jnp.clip(beam_ids, 0, N - 1)
    rows = block_tables[parent]
    lens = kv_lens[parent]
    last = jnp.clip((lens - 1) // page_size, 0, block_tables.shape[1] - 1)  # [N]
    partial = (lens % page_size) != 0
    tail = jnp.take_along_axis(rows, last[:, None], axis=1)[:, 0]  # each parent's last page
    src = jnp.where(partial, tail, -1)
    dst = jnp.where(partial, spare_pages, -1)
    rows = rows.at[jnp.arange(N), last].set(jnp.where(partial, spare_pages, tail))
    old_last = jnp.clip((kv_lens - 1) // page_size, 0, block_tables.shape[1] - 1)
    old_tail = jnp.take_along_axis(block_tables, old_last[:, None], axis=1)[:, 0]
    new_spare = jnp.where((kv_lens % page_size) != 0, old_tail, spare_pages)
    caches = copy_pages(
        k_pages, v_pages, src, dst, k_scale=k_scale, v_scale=v_scale,
        implementation=implementation,
    )  # fmt: skip
    return rows, lens, new_spare, caches


def check_paged_inputs(block_tables, kv_lens, num_pages: int, page_size: int):
    """Debug check of paged-attention inputs under ``jax.experimental.checkify``.

    Reports the first bad entry by name: a ``kv_lens[b]`` outside ``[0, max_pages * page_size]``
    or a ``block_tables[b, j]`` outside ``[0, num_pages)`` among the pages ``kv_lens[b]`` uses.
    Call it inside a function wrapped by ``checkify.checkify`` (then ``err.throw()``)."""
    B, max_pages = block_tables.shape
    cap = max_pages * page_size
    bad_len = (kv_lens < 0) | (kv_lens > cap)
    b = jnp.argmax(bad_len)
    checkify.check(
        ~jnp.any(bad_len),
        "kv_lens[{b}] = {v} is outside [0, {cap}] (max_pages * page_size)",
        b=b,
        v=kv_lens[b],
        cap=jnp.int32(cap),
    )
    pages_used = (jnp.clip(kv_lens, 0, cap) + page_size - 1) // page_size
    used = jnp.arange(max_pages)[None, :] < pages_used[:, None]
    bad_id = used & ((block_tables < 0) | (block_tables >= num_pages))
    flat = jnp.argmax(bad_id.reshape(-1))
    checkify.check(
        ~jnp.any(bad_id),
        "block_tables[{b}, {j}] = {v} is outside [0, {n}) (num_pages)",
        b=flat // max_pages,
        j=flat % max_pages,
        v=block_tables.reshape(-1)[flat],
        n=jnp.int32(num_pages),
    )
