"""Cache-write primitives, in place: `jax_flash_append_kv` and `jax_flash_copy_pages`.

Both alias their four cache operands (k_pages, v_pages, k_scale, v_scale) to their four results,
so that under `jit` with the cache donated XLA updates the cache where it lies, with no copy.

    append_kv   operands k_pages, v_pages, k_scale, v_scale, k_new [T,Hkv,D], v_new [T,Hkv,Dv],
                slot_mapping [T] int32
    copy_pages  operands k_pages, v_pages, k_scale, v_scale, src [N] int32, dst [N] int32
    results     k_pages, v_pages, k_scale, v_scale (updated)

Layouts and rules (quantisation, skipped slots and ids): cuda/include/jax_flash/paged_params.h.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .. import reference
from .._compat import NOT_MAPPED, batching
from ._common import batch_first, make_primitive, register_lowerings

_ALIASES = {0: 0, 1: 1, 2: 2, 3: 3}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    scale_mode: int  # 0 none, 1 per head, 2 per token
    implementation: str | None


append_kv_p = make_primitive("jax_flash_append_kv")
copy_pages_p = make_primitive("jax_flash_copy_pages")


def _cache_avals(kp, vp, ks, vs, *rest, config):
    del rest, config
    return kp, vp, ks, vs


append_kv_p.def_abstract_eval(_cache_avals)
copy_pages_p.def_abstract_eval(_cache_avals)


def _attrs(config: CacheConfig) -> dict:
    return {"scale_mode": np.int32(config.scale_mode)}


def _scales(config, ks, vs):
    return (None, None) if config.scale_mode == 0 else (ks, vs)


def _append_reference(kp, vp, ks, vs, k_new, v_new, slots, *, config):
    sk, sv = _scales(config, ks, vs)
    kp, vp, sk, sv = reference.append_kv(kp, vp, k_new, v_new, slots, k_scale=sk, v_scale=sv)
    return [kp, vp, ks if sk is None else sk, vs if sv is None else sv]


def _copy_reference(kp, vp, ks, vs, src, dst, *, config):
    sk, sv = _scales(config, ks, vs)
    kp, vp, sk, sv = reference.copy_pages(kp, vp, src, dst, k_scale=sk, v_scale=sv)
    return [kp, vp, ks if sk is None else sk, vs if sv is None else sv]


register_lowerings(append_kv_p, "append_kv", _attrs, _append_reference, aliases=_ALIASES)
register_lowerings(copy_pages_p, "copy_pages", _attrs, _copy_reference, aliases=_ALIASES)


def _stack_caches(args, dims, size, config):
    """Caches of all instances stacked along pages (per-head scales become per-token)."""
    kp, vp, ks, vs = (batch_first(x, d, size) for x, d in zip(args[:4], dims[:4], strict=True))
    P, page = kp.shape[1], kp.shape[2]
    mode = config.scale_mode
    if mode == 1:
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
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    flat, P, page, config_b = _stack_caches(args, dims, size, config)
    k_new, v_new, slots = (batch_first(x, d, size) for x, d in zip(args[4:], dims[4:], strict=True))
    off = (jnp.arange(size, dtype=jnp.int32) * (P * page))[:, None]
    slots = jnp.where((slots >= 0) & (slots < P * page), slots + off, -1)
    outs = append_kv_p.bind(
        *flat,
        k_new.reshape(-1, *k_new.shape[2:]),
        v_new.reshape(-1, *v_new.shape[2:]),
        slots.reshape(-1),
        config=config_b,
    )
    return _unstack(outs, size, config, config_b)


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
batching.primitive_batchers[copy_pages_p] = _batch_copy
