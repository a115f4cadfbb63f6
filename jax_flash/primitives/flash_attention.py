"""The `jax_flash_attention` primitive: fused attention over packed sequences.

One primitive serves the dense (padded) and the varlen APIs: both are expressed in the packed form
of cuda/include/jax_flash/flash_params.h (sequence b owns q rows [q_starts[b], q_ends[b]) and k/v
rows [k_starts[b], k_ends[b])).

    operands  q [Tq,Hq,D], k [Tk,Hkv,D], v [Tk,Hkv,Dv], q_starts/q_ends/k_starts/k_ends [B] int32
    results   o [Tq,Hq,Dv] (dtype of q), lse [Hq,Tq] float32
    params    config: FlashConfig (static, hashable)

With config.dense (the padded API) the rows are B equal blocks, Tq = B*Sq and Tk = B*Skv, and
sequence b's rows lie in block b: the row axes may then be split by whole sequences (batch
sharding), with the starts/ends made local to the shard, and within one sequence (context
parallelism: sequence_sharding.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax.numpy as jnp
import numpy as np

from .. import reference
from .._compat import NOT_MAPPED, ShapedArray, batching
from .._native import _cpu
from ._common import batch_first, make_primitive, register_lowerings
from .partitioning import Partitioning, local_index, make_rule
from .sequence_sharding import SequenceShards, sequence_sharded_prefill

# Largest head dim the CUDA kernels take (cuda/include/jax_flash/policy/limits.h).
CUDA_MAX_HEAD_DIM = _cpu.policy.FLASH_MAX_HEAD_DIM


BWD_HOPPER_KERNELS = ("hopper", "mma")


@dataclasses.dataclass(frozen=True)
class FlashBwdLaunch:
    """How the CUDA backward runs a call (the FFI attribute hopper_kernel of
    cuda/ffi/flash_attention_bwd_common.h); the CPU kernel ignores it.

    hopper_kernel: on a compute capability 9.0 device, "hopper" runs the wgmma backwards
    (hopper/flash_bwd_kernel.cuh, and hopper/flash_bwd_wide_kernel.cuh past head dim 128) on
    the calls they take, "mma" keeps them on the mma.sync backward (the SIMT backward for the
    head dims that one does not take: all but 64, 128 and the multiples of 16 in (128, 256]
    with D == Dv), to time both kernels in one build or to avoid the newer one.
    strict: with "hopper", a call the Hopper kernel takes but whose TMA descriptors the driver
    rejects fails (an error naming it) instead of running the mma.sync backward, so that tests
    and timings of the Hopper kernel cannot measure the other one unawares."""

    hopper_kernel: str = "hopper"
    strict: bool = False

    def __post_init__(self):
        if self.hopper_kernel not in BWD_HOPPER_KERNELS:
            raise ValueError(
                f"FlashBwdLaunch: hopper_kernel must be one of {BWD_HOPPER_KERNELS}, "
                f"got {self.hopper_kernel!r}"
            )


@functools.cache
def default_bwd_launch() -> FlashBwdLaunch:
    """The backward's launch options of calls that name none, from the environment (read once,
    here only): JAX_FLASH_BWD_HOPPER="0" keeps the mma.sync backward on Hopper; unset or any
    other value, the Hopper kernel wherever it takes the call."""
    hopper = os.environ.get("JAX_FLASH_BWD_HOPPER") != "0"
    return FlashBwdLaunch(hopper_kernel="hopper" if hopper else "mma")


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
    # Rows are B equal blocks, sequence b's in block b (the padded API): batch sharding splits
    # the row axes by whole sequences. False (varlen): the row axes are never split.
    dense: bool = False
    # Backward only (the forward ignores it): no atomics in any accumulation, so gradients are
    # bit-identical run to run.
    deterministic: bool = False
    # Private: the q rows each device computes when the sequence axis is sharded
    # (sequence_sharding.row_layout): "auto" balances causal masks, "natural" keeps each device
    # on its own rows (benchmarks time both).
    _sequence_layout: str = "auto"
    # Private, backward only: the launch options (tests pick the backward kernel through it);
    # default_bwd_launch() unless set.
    _bwd_launch: FlashBwdLaunch = dataclasses.field(default_factory=default_bwd_launch)


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


# The CUDA kernels' names by policy::FlashChoice (cuda/include/jax_flash/policy/flash.h).
_FLASH_KERNELS = {v: k for k, v in _cpu.policy.FLASH_CHOICES.items()}


def _cuda_kernel(avals_in, config):
    q_aval, _, v_aval = avals_in[:3]
    d, dv = q_aval.shape[2], v_aval.shape[2]
    choice = _cpu.policy.flash_kernel_choice(
        jnp.dtype(q_aval.dtype).name, d, dv, config.softmax_scale, config.softcap
    )
    if _FLASH_KERNELS[choice] == "none":
        return None, (
            f"the CUDA kernels take head dims up to {CUDA_MAX_HEAD_DIM}, got head_dim={d}, "
            f"head_dim_v={dv}"
        )
    return _FLASH_KERNELS[choice], None


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


def _rule(config, shapes_in, shapes_out):
    # Heads: q head h*g + j reads kv head h, so a shard of kv heads takes its q heads' block.
    # Head dims stay whole (the kernel contracts over D).
    (tq, hq, _), (tk, hkv, _) = shapes_in[:2]
    nb = shapes_in[3][0]
    sizes = {"g": hq // hkv}
    whole = ("d", "e")
    if config.dense:
        ops = ["(b s) (h g) d", "(b t) h d", "(b t) h e", "b", "b", "b", "b"]
        res = ["(b s) (h g) e", "(h g) (b s)"]
        sizes.update(s=tq // nb, t=tk // nb)
        whole += sequence_sharded_prefill(config)
    else:
        # Packed sequences of any lengths: the rows (and so the sequences) stay whole.
        ops = ["s (h g) d", "t h d", "t h e", "b", "b", "b", "b"]
        res = ["s (h g) e", "(h g) s"]
        whole += ("s", "t", "b")
    return make_rule(
        ops, res, shapes_in, shapes_out, whole=whole, sizes=sizes, share_axes=[("s", "t")]
    )


def shard_local_starts(got):
    """A batch shard's starts/ends are global row offsets: localise(tq, tk, qs, qe, ks, ke)
    makes them local to the shard's tq q rows and tk k rows (its first sequence is
    local_index * B_local). None when the batch is not split."""
    axes = got.get("b", ())
    if not axes:
        return None

    def localise(tq, tk, qs, qe, ks, ke):
        nb = qs.shape[0]
        first = local_index(axes) * nb
        q0 = (first * (tq // nb)).astype(jnp.int32)
        k0 = (first * (tk // nb)).astype(jnp.int32)
        return qs - q0, qe - q0, ks - k0, ke - k0

    return localise


def _per_shard(config, got):
    seq = SequenceShards.of(got)
    if seq is not None:  # context parallelism: q rows (balanced) against all of their K/V

        def cp_call(q, k, v, *starts):
            k, v = seq.gather_kv(k), seq.gather_kv(v)
            layout = seq.layout(config, q.shape[0])
            calls = seq.segment_calls(config, layout, q.shape[0], k.shape[0], *starts)
            # The zigzag layout's two half-blocks run as two packed sequences of one call.
            local, starts = seq.packed(config, calls)
            o, lse = flash_attention_p.bind(seq.to_layout(layout, q), k, v, *starts, config=local)
            return seq.from_layout(layout, o), seq.from_layout(layout, lse, axis=1)

        return cp_call
    localise = shard_local_starts(got)
    if localise is None:
        return None

    def call(q, k, v, *starts):
        starts = localise(q.shape[0], k.shape[0], *starts)
        return flash_attention_p.bind(q, k, v, *starts, config=config)

    return call


register_lowerings(
    flash_attention_p, "flash_attention", _ffi_attrs, _reference, _cuda_kernel,
    partitioning=Partitioning(_rule, _per_shard),
    # The Hopper kernel's work-item counter (policy::flash_hopper_dynamic_items).
    cuda_scratch=(ShapedArray((2,), jnp.int32),),
)  # fmt: skip


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
