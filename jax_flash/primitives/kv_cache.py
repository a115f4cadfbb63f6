"""Cache-write primitives, in place: `jax_flash_append_kv`, `jax_flash_append_kv_rope` (the
cache write with RoPE fused in), `jax_flash_append_qkv_rope` (the same reading packed q/k/v
rows) and `jax_flash_copy_pages`.

All alias their four cache operands (k_pages, v_pages, k_scale, v_scale) to their first four
results, so that under `jit` with the cache donated XLA updates the cache where it lies.

    append_kv       operands k_pages, v_pages, k_scale, v_scale, k_new [T,Hkv,D],
                    v_new [T,Hkv,Dv], slot_mapping [T] int32
    append_kv_rope  operands as append_kv, then positions [T] int32, q [T,Hq,D] (Hq = 0: no
                    queries); one more result q_out [T,Hq,D]; attrs style, rotary_dim, inv_freq
                    (static, in the config, as apply_rope's)
    append_qkv_rope operands k_pages, v_pages, k_scale, v_scale, qkv [T,Hkv,G+2,D] (packed
                    rows, reference.split_qkv), slot_mapping [T], positions [T]; results and
                    attrs as append_kv_rope, q_out [T,G*Hkv,D]
    copy_pages      operands k_pages, v_pages, k_scale, v_scale, src [N] int32, dst [N] int32
    results         k_pages, v_pages, k_scale, v_scale (updated)

Layouts and rules (quantisation, skipped slots and ids): cuda/include/jax_flash/paged_params.h;
the fused RoPE: cuda/include/jax_flash/kv_cache_rope_params.h.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from .._compat import NOT_MAPPED, ShapedArray, batching
from .._native import _cpu
from ._common import batch_first, make_primitive, register_lowerings
from .paged_attention import scale_dims
from .partitioning import Partitioning, make_rule
from .rope import STYLES

_ALIASES = {0: 0, 1: 1, 2: 2, 3: 3}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    scale_mode: int  # 0 none, 1 per head, 2 per token
    implementation: str | None


@dataclasses.dataclass(frozen=True)
class RopeCacheConfig:
    """append_kv_rope: the cache write's scale mode and apply_rope's static options."""

    scale_mode: int  # 0 none, 1 per head, 2 per token
    style: str  # "neox" | "gptj"
    rotary_dim: int
    inv_freq: tuple[float, ...]  # float32 values
    implementation: str | None


append_kv_p = make_primitive("jax_flash_append_kv")
append_kv_rope_p = make_primitive("jax_flash_append_kv_rope")
append_qkv_rope_p = make_primitive("jax_flash_append_qkv_rope")
copy_pages_p = make_primitive("jax_flash_copy_pages")


def _cache_avals(kp, vp, ks, vs, *rest, config):
    del rest, config
    return kp, vp, ks, vs


def _rope_cache_avals(kp, vp, ks, vs, k_new, v_new, slots, positions, q, *, config):
    del k_new, v_new, slots, positions, config
    return kp, vp, ks, vs, ShapedArray(q.shape, q.dtype)


def _qkv_cache_avals(kp, vp, ks, vs, qkv, slots, positions, *, config):
    del slots, positions, config
    T, Hkv, G2, D = qkv.shape
    return kp, vp, ks, vs, ShapedArray((T, Hkv * (G2 - 2), D), qkv.dtype)


append_kv_p.def_abstract_eval(_cache_avals)
append_kv_rope_p.def_abstract_eval(_rope_cache_avals)
append_qkv_rope_p.def_abstract_eval(_qkv_cache_avals)
copy_pages_p.def_abstract_eval(_cache_avals)


def _attrs(config: CacheConfig) -> dict:
    return {"scale_mode": np.int32(config.scale_mode)}


def _scales(config, ks, vs):
    return (None, None) if config.scale_mode == 0 else (ks, vs)


def _append_reference(kp, vp, ks, vs, k_new, v_new, slots, *, config):
    sk, sv = _scales(config, ks, vs)
    kp, vp, sk, sv = reference.append_kv(kp, vp, k_new, v_new, slots, k_scale=sk, v_scale=sv)
    return [kp, vp, ks if sk is None else sk, vs if sv is None else sv]


def _rope_attrs(config: RopeCacheConfig) -> dict:
    return {
        "scale_mode": np.int32(config.scale_mode),
        "style": np.int32(STYLES[config.style]),
        "rotary_dim": np.int32(config.rotary_dim),
        "inv_freq": np.asarray(config.inv_freq, np.float32),
    }


def _append_rope_reference(kp, vp, ks, vs, k_new, v_new, slots, positions, q, *, config):
    sk, sv = _scales(config, ks, vs)
    q_rot, kp, vp, sk, sv = reference.append_kv_rope(
        kp, vp, k_new, v_new, slots, positions, np.asarray(config.inv_freq, np.float32),
        style=config.style, rotary_dim=config.rotary_dim, q=q, k_scale=sk, v_scale=sv,
    )  # fmt: skip
    return [kp, vp, ks if sk is None else sk, vs if sv is None else sv, q_rot]


def _append_qkv_rope_reference(kp, vp, ks, vs, qkv, slots, positions, *, config):
    q, k_new, v_new = reference.split_qkv(qkv)
    return _append_rope_reference(kp, vp, ks, vs, k_new, v_new, slots, positions, q, config=config)


def _copy_reference(kp, vp, ks, vs, src, dst, *, config):
    sk, sv = _scales(config, ks, vs)
    kp, vp, sk, sv = reference.copy_pages(kp, vp, src, dst, k_scale=sk, v_scale=sv)
    return [kp, vp, ks if sk is None else sk, vs if sv is None else sv]


def _cache_dims(config):
    """The cache operands' (and results') dims: pages, a page's rows and head dims stay whole
    (slots and page ids are global); kv heads (h) split, with no communication."""
    return ["p n h d", "p n h e", *scale_dims(config.scale_mode)]


_CACHE_WHOLE = ("p", "n", "d", "e")


def _append_rule(config, shapes_in, shapes_out):
    # The new rows (t) stay whole: every device writes its heads of every row into its cache.
    cache = _cache_dims(config)
    ops = [*cache, "t h d", "t h e", "t"]
    return make_rule(ops, cache, shapes_in, shapes_out, whole=(*_CACHE_WHOLE, "t"))


def _copy_rule(config, shapes_in, shapes_out):
    cache = _cache_dims(config)
    return make_rule([*cache, "i", "i"], cache, shapes_in, shapes_out, whole=(*_CACHE_WHOLE, "i"))


def _append_rope_rule(config, shapes_in, shapes_out):
    # As append_kv; q head h*g + j goes with kv head h (q [T, 0, D]: no queries).
    cache = _cache_dims(config)
    hq, hkv = shapes_in[8][1], shapes_in[4][1]
    q = "t (h g) d" if hq else "t zq d"
    ops = [*cache, "t h d", "t h e", "t", "t", q]
    return make_rule(
        ops, [*cache, q], shapes_in, shapes_out, whole=(*_CACHE_WHOLE, "t"),
        sizes={"g": hq // hkv} if hq else None,
    )  # fmt: skip


def _append_qkv_rope_rule(config, shapes_in, shapes_out):
    # As append_kv_rope; the packed rows' group axis (G + 2) stays whole.
    cache = _cache_dims(config)
    hq, hkv = shapes_out[4][1], shapes_in[4][1]
    ops = [*cache, "t h x d", "t", "t"]
    return make_rule(
        ops, [*cache, "t (h g) d"], shapes_in, shapes_out, whole=(*_CACHE_WHOLE, "t", "x"),
        sizes={"g": hq // hkv},
    )  # fmt: skip


register_lowerings(
    append_kv_p, "append_kv", _attrs, _append_reference, aliases=_ALIASES,
    partitioning=Partitioning(_append_rule),
)  # fmt: skip
register_lowerings(
    copy_pages_p, "copy_pages", _attrs, _copy_reference, aliases=_ALIASES,
    partitioning=Partitioning(_copy_rule),
)  # fmt: skip
# A quantized cache's K row staged in shared memory (cuda/include/jax_flash/policy/limits.h).
MAX_QUANT_ROW_BYTES = _cpu.policy.ROPE_MAX_QUANT_ROW_BYTES


def _rope_cuda_kernel(avals_in, config):
    # k_new [T, Hkv, D] (append_kv_rope) or qkv [T, Hkv, G + 2, D] (append_qkv_rope)
    new = avals_in[4]
    row = new.shape[-1] * new.dtype.itemsize
    if config.scale_mode != 0 and row > MAX_QUANT_ROW_BYTES:
        return None, (
            f"the fused RoPE CUDA kernel takes head dims up to "
            f"{MAX_QUANT_ROW_BYTES // new.dtype.itemsize} ({new.dtype}) for a quantized "
            f"cache, got {new.shape[-1]}"
        )
    return None, None


register_lowerings(
    append_kv_rope_p,
    "append_kv_rope",
    _rope_attrs,
    _append_rope_reference,
    cuda_kernel=_rope_cuda_kernel,
    aliases=_ALIASES,
    partitioning=Partitioning(_append_rope_rule),
)

register_lowerings(
    append_qkv_rope_p,
    "append_qkv_rope",
    _rope_attrs,
    _append_qkv_rope_reference,
    cuda_kernel=_rope_cuda_kernel,
    aliases=_ALIASES,
    partitioning=Partitioning(_append_qkv_rope_rule),
)


def _stack_caches(args, dims, size, config, per_head_read=False):
    """Caches of all instances stacked along pages. Per-head scales become per-token ones for
    copy_pages (which only copies them); for the appends (per_head_read: the kernel reads them)
    they must be shared by all instances and stay per head (see _per_instance)."""
    kp, vp, ks, vs = (batch_first(x, d, size) for x, d in zip(args[:4], dims[:4], strict=True))
    P, page = kp.shape[1], kp.shape[2]
    mode = config.scale_mode
    if mode == 1 and not per_head_read:
        ks, vs = (
            jnp.broadcast_to(s[:, None, None, :], (size, P, page, s.shape[-1])) for s in (ks, vs)
        )
        mode = 2
    flat = [x.reshape(size * x.shape[1], *x.shape[2:]) for x in (kp, vp)]
    if mode == 2:
        flat += [x.reshape(size * P, *x.shape[2:]) for x in (ks, vs)]
    else:
        flat += [ks[0], vs[0]]
    return flat, P, page, dataclasses.replace(config, scale_mode=mode)


def _shift_slots(slots, size: int, instance_slots: int):
    """Slots ``[size, T]`` of each instance's own cache, as slots of the caches stacked along
    pages (instance i's shifted by i * instance_slots); the ones it skips stay skipped (-1)."""
    off = (jnp.arange(size, dtype=jnp.int32) * instance_slots)[:, None]
    return jnp.where((slots >= 0) & (slots < instance_slots), slots + off, -1)


def _scales_mapped_per_head(dims, config) -> bool:
    return config.scale_mode == 1 and (dims[2] is not NOT_MAPPED or dims[3] is not NOT_MAPPED)


def _per_instance(p, args, dims, config):
    """Instances one after the other (lax.map of the primitive): for per-head scales that differ
    between instances, which one call cannot read."""
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    args = [batch_first(x, d, size) for x, d in zip(args, dims, strict=True)]
    outs = jax.lax.map(lambda a: p.bind(*a, config=config), args)
    return list(outs), [0] * len(outs)


def _unstack(outs, size, config_in, config_out):
    kp, vp, ks, vs = outs
    kp = kp.reshape(size, -1, *kp.shape[1:])
    vp = vp.reshape(size, -1, *vp.shape[1:])
    if config_out.scale_mode == 2:
        ks = ks.reshape(size, -1, *ks.shape[1:])
        vs = vs.reshape(size, -1, *vs.shape[1:])
        if config_in.scale_mode == 1:  # per-head scales are only read: return them as given
            ks, vs = ks[:, 0, 0], vs[:, 0, 0]
        return [kp, vp, ks, vs], [0, 0, 0, 0]
    return [kp, vp, ks, vs], [0, 0, NOT_MAPPED, NOT_MAPPED]


def _batch_append(args, dims, *, config):
    # Every instance writes its own copy of the cache (vmap semantics): stack the caches along
    # pages and shift each instance's slots by its pages.
    if _scales_mapped_per_head(dims, config):
        return _per_instance(append_kv_p, args, dims, config)
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    flat, P, page, config_b = _stack_caches(args, dims, size, config, per_head_read=True)
    k_new, v_new, slots = (batch_first(x, d, size) for x, d in zip(args[4:], dims[4:], strict=True))
    slots = _shift_slots(slots, size, P * page)
    outs = append_kv_p.bind(
        *flat,
        k_new.reshape(-1, *k_new.shape[2:]),
        v_new.reshape(-1, *v_new.shape[2:]),
        slots.reshape(-1),
        config=config_b,
    )
    return _unstack(outs, size, config, config_b)


def _batch_append_rope(args, dims, *, config):
    # As _batch_append; the queries and positions of every instance are more tokens.
    if _scales_mapped_per_head(dims, config):
        return _per_instance(append_kv_rope_p, args, dims, config)
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    flat, P, page, config_b = _stack_caches(args, dims, size, config, per_head_read=True)
    k_new, v_new, slots, positions, q = (
        batch_first(x, d, size) for x, d in zip(args[4:], dims[4:], strict=True)
    )
    slots = _shift_slots(slots, size, P * page)
    outs = append_kv_rope_p.bind(
        *flat,
        k_new.reshape(-1, *k_new.shape[2:]),
        v_new.reshape(-1, *v_new.shape[2:]),
        slots.reshape(-1),
        positions.reshape(-1),
        q.reshape(size * q.shape[1], *q.shape[2:]),  # explicit: Hq may be 0
        config=config_b,
    )
    caches, cache_dims = _unstack(outs[:4], size, config, config_b)
    return [*caches, outs[4].reshape(q.shape)], [*cache_dims, 0]


def _batch_append_qkv_rope(args, dims, *, config):
    # As _batch_append_rope, the packed rows of every instance being more tokens.
    if _scales_mapped_per_head(dims, config):
        return _per_instance(append_qkv_rope_p, args, dims, config)
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    flat, P, page, config_b = _stack_caches(args, dims, size, config, per_head_read=True)
    qkv, slots, positions = (
        batch_first(x, d, size) for x, d in zip(args[4:], dims[4:], strict=True)
    )
    slots = _shift_slots(slots, size, P * page)
    outs = append_qkv_rope_p.bind(
        *flat,
        qkv.reshape(-1, *qkv.shape[2:]),
        slots.reshape(-1),
        positions.reshape(-1),
        config=config_b,
    )
    caches, cache_dims = _unstack(outs[:4], size, config, config_b)
    return [*caches, outs[4].reshape(size, -1, *outs[4].shape[1:])], [*cache_dims, 0]


def _batch_copy(args, dims, *, config):
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    flat, P, _, config_b = _stack_caches(args, dims, size, config)
    src, dst = (batch_first(x, d, size) for x, d in zip(args[4:], dims[4:], strict=True))
    off = (jnp.arange(size, dtype=jnp.int32) * P)[:, None]

    def shift(ids):
        return jnp.where((ids >= 0) & (ids < P), ids + off, -1).reshape(-1)

    outs = copy_pages_p.bind(*flat, shift(src), shift(dst), config=config_b)
    return _unstack(outs, size, config, config_b)


batching.primitive_batchers[append_kv_p] = _batch_append
batching.primitive_batchers[append_kv_rope_p] = _batch_append_rope
batching.primitive_batchers[append_qkv_rope_p] = _batch_append_qkv_rope
batching.primitive_batchers[copy_pages_p] = _batch_copy
