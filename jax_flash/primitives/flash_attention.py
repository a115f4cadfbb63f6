"""The `jax_flash_attention` primitive: fused attention over packed sequences.

One primitive serves the dense (padded) and the varlen APIs: both are expressed in the packed form
of cuda/include/jax_flash/flash_params.h (sequence b owns q rows [q_starts[b], q_ends[b]) and k/v
rows [k_starts[b], k_ends[b])).

    operands  q [Tq,Hq,D], k [Tk,Hkv,D], v [Tk,Hkv,Dv], q_starts/q_ends/k_starts/k_ends [B] int32
    results   o [Tq,Hq,Dv] (dtype of q), lse [Hq,Tq] float32
    params    config: FlashConfig (static, hashable)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .. import reference
from .._compat import NOT_MAPPED, ShapedArray, batching
from .._native import _cpu
from ._common import batch_first, make_primitive, register_lowerings

# Largest head dim the CUDA kernels take (cuda/include/jax_flash/policy/limits.h).
CUDA_MAX_HEAD_DIM = _cpu.policy.FLASH_MAX_HEAD_DIM


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static configuration of one flash_attention call (everything that is not an array)."""

    softmax_scale: float
    softcap: float  # 0.0: off
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded; 0: causal
    max_seqlen_q: int  # rows of a sequence beyond this are left to fill_uncovered
    fill_uncovered: bool  # rows no sequence owns get o = 0, lse = -inf
    implementation: str | None  # None (native for the platform), "cuda" or "cpu"


flash_attention_p = make_primitive("jax_flash_attention")


def _abstract_eval(q, k, v, q_starts, q_ends, k_starts, k_ends, *, config):
    del k, q_starts, q_ends, k_starts, k_ends, config
    return (
        ShapedArray((q.shape[0], q.shape[1], v.shape[2]), q.dtype),
        ShapedArray((q.shape[1], q.shape[0]), jnp.float32),
    )


flash_attention_p.def_abstract_eval(_abstract_eval)


def _ffi_attrs(config: FlashConfig) -> dict:
    # Attribute types must match the C++ handler exactly (f32 / i32).
    return {
        "softmax_scale": np.float32(config.softmax_scale),
        "softcap": np.float32(config.softcap),
        "window_left": np.int32(config.window_left),
        "window_right": np.int32(config.window_right),
        "max_seqlen_q": np.int32(config.max_seqlen_q),
        "fill_uncovered": np.int32(config.fill_uncovered),
    }


def _check_cuda(ctx, config):
    q_aval, _, v_aval = ctx.avals_in[:3]
    d, dv = q_aval.shape[2], v_aval.shape[2]
    if max(d, dv) > CUDA_MAX_HEAD_DIM:
        return (
            f"the CUDA kernel takes head dims up to {CUDA_MAX_HEAD_DIM}, got head_dim={d}, "
            f"head_dim_v={dv}"
        )
    return None


def _reference(*args, config):
    # Platforms without a native kernel (e.g. TPU, ROCm) run the jnp reference.
    return list(
        reference.attention_packed(
            *args,
            softmax_scale=config.softmax_scale,
            softcap=config.softcap,
            window_left=config.window_left,
            window_right=config.window_right,
            max_seqlen_q=config.max_seqlen_q,
        )
    )


register_lowerings(flash_attention_p, "flash_attention", _ffi_attrs, _reference, _check_cuda)


def _batch(args, dims, *, config):
    q, k, v, qs, qe, ks, ke = args
    qd, kd, vd, qsd, qed, ksd, ked = dims
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)

    if all(d is NOT_MAPPED for d in (kd, vd, qsd, qed, ksd, ked)):
        # Only q is mapped: the mapped axis is more query heads of the same sequences (GQA), so
        # fold it into heads. Head h*size + n still reads kv head h // (Hq / Hkv).
        qm = jnp.moveaxis(q, qd, 2)  # [Tq, Hq, N, D]
        tq, hq = qm.shape[0], qm.shape[1]
        qm = qm.reshape(tq, hq * size, qm.shape[3])
        o, lse = flash_attention_p.bind(qm, k, v, qs, qe, ks, ke, config=config)
        o = o.reshape(tq, hq, size, o.shape[2])
        lse = lse.reshape(hq, size, tq)
        return (o, lse), (2, 1)

    # Otherwise fold the mapped axis into the packed rows: instance n's rows follow instance
    # n-1's, and its sequences' starts/ends are shifted by n rows-per-instance.
    qm, km, vm = batch_first(q, qd, size), batch_first(k, kd, size), batch_first(v, vd, size)
    tq, tk = qm.shape[1], km.shape[1]
    q_off = (jnp.arange(size, dtype=jnp.int32) * tq)[:, None]
    k_off = (jnp.arange(size, dtype=jnp.int32) * tk)[:, None]
    # Clamp per instance first (as the kernels do), so that no instance reaches into another's.
    qs_n = jnp.clip(batch_first(qs, qsd, size), 0, tq)
    qe_n = jnp.clip(batch_first(qe, qed, size), qs_n, tq)
    ks_n = jnp.clip(batch_first(ks, ksd, size), 0, tk)
    ke_n = jnp.clip(batch_first(ke, ked, size), ks_n, tk)
    qs2, qe2 = (qs_n + q_off).reshape(-1), (qe_n + q_off).reshape(-1)
    ks2, ke2 = (ks_n + k_off).reshape(-1), (ke_n + k_off).reshape(-1)
    o, lse = flash_attention_p.bind(
        qm.reshape((size * tq,) + qm.shape[2:]),
        km.reshape((size * tk,) + km.shape[2:]),
        vm.reshape((size * tk,) + vm.shape[2:]),
        qs2,
        qe2,
        ks2,
        ke2,
        config=config,
    )
    o = o.reshape((size, tq) + o.shape[1:])
    lse = lse.reshape(lse.shape[0], size, tq)
    return (o, lse), (0, 1)


batching.primitive_batchers[flash_attention_p] = _batch
