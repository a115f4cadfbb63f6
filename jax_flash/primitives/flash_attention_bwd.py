"""The `jax_flash_attention_bwd` primitive: gradients of fused attention over packed sequences.

The backward of `jax_flash_attention` (same packed form and masking, same static FlashConfig),
with the FFI contract of cuda/include/jax_flash/flash_bwd_params.h and
cuda/ffi/flash_attention_bwd_common.h:

    operands  q [Tq,Hq,D], k [Tk,Hkv,D], v [Tk,Hkv,Dv], o [Tq,Hq,Dv]   (dtype of q)
              lse [Hq,Tq] f32 (forward results), do [Tq,Hq,Dv] (dtype of q), dlse [Hq,Tq] f32
              q_starts/q_ends/k_starts/k_ends [B] int32
    results   dq [Tq,Hq,D], dk [Tk,Hkv,D], dv [Tk,Hkv,Dv] (dtype of q)
    params    config: FlashConfig (config.deterministic and config._bwd_launch reach the kernel)

The kernels recompute the probabilities from lse (O(S) extra memory, never [Sq, Skv]); rows
that see no key and rows no sequence owns get zero gradients. Differentiation itself (the
custom_vjp around the forward's bind) is in flash_attention_vjp.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import _native, reference
from .._compat import NOT_MAPPED, ShapedArray, batching
from . import flash_attention as forward
from ._common import batch_first, make_primitive, register_lowerings
from .flash_attention import FlashConfig, shard_local_starts
from .partitioning import Partitioning, make_rule
from .sequence_sharding import SequenceShards, sequence_sharded_prefill

CUDA_TARGET = "jax_flash_flash_attention_bwd_cuda"

flash_attention_bwd_p = make_primitive("jax_flash_attention_bwd")


def _abstract_eval(q, k, v, o, lse, do, dlse, q_starts, q_ends, k_starts, k_ends, *, config):
    del o, lse, do, dlse, q_starts, q_ends, k_starts, k_ends, config
    return (
        ShapedArray(q.shape, q.dtype),
        ShapedArray(k.shape, q.dtype),
        ShapedArray(v.shape, q.dtype),
    )


flash_attention_bwd_p.def_abstract_eval(_abstract_eval)


def _hopper_attr(launch) -> int:
    """The FFI attribute hopper_kernel: 0 the mma.sync backward, 1 the Hopper backward where it
    takes the call, 2 the same but failing where its TMA descriptors are rejected."""
    if launch.hopper_kernel != "hopper":
        return 0
    return 2 if launch.strict else 1


def _ffi_attrs(config: FlashConfig) -> dict:
    return {
        **forward._ffi_attrs(config),
        "deterministic": np.int32(config.deterministic),
        "hopper_kernel": np.int32(_hopper_attr(config._bwd_launch)),
    }


def _cuda_kernel(avals_in, config):
    # The backward kernels take the head dims the forward's do (q, k, v lead the operands); one
    # FFI target, which picks its tensor-core or SIMT kernel itself.
    if not _native.has_cuda_target(CUDA_TARGET):
        return None, "this build of jax_flash has no CUDA backward kernel"
    if avals_in[2].shape[2] == 0:
        return None, "the CUDA backward kernels take head_dim_v >= 1, got 0"
    name, reason = forward._cuda_kernel(avals_in, config)
    return (None, None) if name is not None else (None, reason)


def _reference(q, k, v, o, lse, do, dlse, q_starts, q_ends, k_starts, k_ends, *, config):
    # Platforms without a native kernel: reverse mode of the jnp reference (O(Sq*Skv) memory).
    del o, lse

    def forward(q, k, v):
        return reference.attention_packed(
            q,
            k,
            v,
            q_starts,
            q_ends,
            k_starts,
            k_ends,
            softmax_scale=config.softmax_scale,
            softcap=config.softcap,
            window_left=config.window_left,
            window_right=config.window_right,
            max_seqlen_q=config.max_seqlen_q,
        )

    _, vjp = jax.vjp(forward, q, k, v)
    return list(vjp((do, dlse)))


def _rule(config, shapes_in, shapes_out):
    # As the forward's rule: dq like q, dk like k, dv like v; o/do like q's rows and heads,
    # lse/dlse like the forward's lse.
    (tq, hq, _), (tk, hkv, _) = shapes_in[:2]
    nb = shapes_in[7][0]
    sizes = {"g": hq // hkv}
    whole = ("d", "e")
    if config.dense:
        rows_q, rows_k, seqs = "(b s)", "(b t)", "b"
        sizes.update(s=tq // nb, t=tk // nb)
        whole += sequence_sharded_prefill(config)
    else:
        rows_q, rows_k, seqs = "s", "t", "b"
        whole += ("s", "t", "b")
    q_, k_, v_ = f"{rows_q} (h g) d", f"{rows_k} h d", f"{rows_k} h e"
    o_, lse_ = f"{rows_q} (h g) e", f"(h g) {rows_q}"
    ops = [q_, k_, v_, o_, lse_, o_, lse_, seqs, seqs, seqs, seqs]
    return make_rule(
        ops, [q_, k_, v_], shapes_in, shapes_out, whole=whole, sizes=sizes, share_axes=[("s", "t")]
    )


def _sum_in_float32(xs):
    """The sum of the calls' dK (or dV), one rounding to their dtype."""
    if len(xs) == 1:
        return xs[0]
    return sum(x.astype(jnp.float32) for x in xs).astype(xs[0].dtype)


def _per_shard(config, got):
    seq = SequenceShards.of(got)
    if seq is not None:  # context parallelism, as the forward's; dK/dV summed over q's shards

        def cp_call(q, k, v, o, lse, do, dlse, *starts):
            kf, vf = seq.gather_kv(k), seq.gather_kv(v)
            layout = seq.layout(config, q.shape[0])
            calls = seq.segment_calls(config, layout, q.shape[0], kf.shape[0], *starts)
            rows = [seq.to_layout(layout, x) for x in (q, o, do)]
            heads = [seq.to_layout(layout, x, axis=1) for x in (lse, dlse)]
            # One call per run of rows: packed sequences may not share k rows in the backward
            # (each writes its dK/dV rows), and the zigzag half-blocks read the same keys.
            grads = []
            for seg, q_len, k_len in calls:
                part = slice(seg.start, seg.start + seg.length)
                own = dataclasses.replace(seg, start=0)
                local, starts = seq.packed(config, [(own, q_len, k_len)])
                grads.append(flash_attention_bwd_p.bind(
                    rows[0][part], kf, vf, rows[1][part], heads[0][:, part], rows[2][part],
                    heads[1][:, part], *starts, config=local,
                ))  # fmt: skip
            dqs, dks, dvs = zip(*grads, strict=True)
            dq = seq.from_layout(layout, jnp.concatenate(dqs))
            dk, dv = _sum_in_float32(dks), _sum_in_float32(dvs)
            return dq, seq.reduce_kv_grad(dk), seq.reduce_kv_grad(dv)

        return cp_call
    localise = shard_local_starts(got)
    if localise is None:
        return None

    def call(q, k, v, o, lse, do, dlse, *starts):
        starts = localise(q.shape[0], k.shape[0], *starts)
        return flash_attention_bwd_p.bind(q, k, v, o, lse, do, dlse, *starts, config=config)

    return call


register_lowerings(
    flash_attention_bwd_p, "flash_attention_bwd", _ffi_attrs, _reference, _cuda_kernel,
    partitioning=Partitioning(_rule, _per_shard),
)  # fmt: skip


def _batch(args, dims, *, config):
    # Every mapped axis is folded into the packed rows, as the forward does in general: instance
    # n's rows follow instance n-1's. (The forward's fold into query heads when only q is mapped
    # does not carry over: dk/dv would come out summed over the instances, but a batched result
    # needs each instance's own; k and v are then broadcast to every instance, the size of the
    # per-instance dk/dv the result holds anyway.)
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    first = [batch_first(x, d, size) for x, d in zip(args, dims, strict=True)]
    q, k, v, o, lse, do, dlse, qs, qe, ks, ke = first
    tq, tk = q.shape[1], k.shape[1]
    q_off = (jnp.arange(size, dtype=jnp.int32) * tq)[:, None]
    k_off = (jnp.arange(size, dtype=jnp.int32) * tk)[:, None]
    # Clamp per instance first (as the kernels do), so that no instance reaches into another's.
    qs = jnp.clip(qs, 0, tq)
    qe = jnp.clip(qe, qs, tq)
    ks = jnp.clip(ks, 0, tk)
    ke = jnp.clip(ke, ks, tk)

    def rows(x):  # [N, T, ...] -> [N*T, ...]
        return x.reshape((-1,) + x.shape[2:])

    def heads_rows(x):  # [N, H, T] -> [H, N*T]
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)

    dq, dk, dv = flash_attention_bwd_p.bind(
        rows(q),
        rows(k),
        rows(v),
        rows(o),
        heads_rows(lse),
        rows(do),
        heads_rows(dlse),
        (qs + q_off).reshape(-1),
        (qe + q_off).reshape(-1),
        (ks + k_off).reshape(-1),
        (ke + k_off).reshape(-1),
        config=config,
    )
    dq = dq.reshape((size, tq) + dq.shape[1:])
    dk = dk.reshape((size, tk) + dk.shape[1:])
    dv = dv.reshape((size, tk) + dv.shape[1:])
    return (dq, dk, dv), (0, 0, 0)


batching.primitive_batchers[flash_attention_bwd_p] = _batch
