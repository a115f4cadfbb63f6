"""The `jax_flash_paged_attention` primitive: attention of queries against a paged KV cache.

    operands  q [B,Sq,Hq,D], k_pages [P,page,Hkv,D], v_pages [P,page,Hkv,Dv],
              k_scale, v_scale ([0] | [Hkv] | [P,page,Hkv] float32),
              block_tables [B,max_pages] int32, kv_lens [B] int32
    results   o [B,Sq,Hq,Dv] (dtype of q), lse [B,Hq,Sq] float32,
              o_partial [splits,B,Sq,Hq,Dv], lse_partial [splits,B,Hq,Sq] float32 (split-KV
              scratch: [0] when splits == 1; dropped by the op)

Semantics and bad-data rules: cuda/include/jax_flash/paged_params.h.
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
from .partitioning import Partitioning, make_rule

SCALE_NONE, SCALE_PER_HEAD, SCALE_PER_TOKEN = 0, 1, 2
# The decisions and limits of the CUDA kernels, from their one home (jax_flash/policy/*.h).
policy = _cpu.policy


@dataclasses.dataclass(frozen=True)
class PagedLaunch:
    """How the CUDA kernels run a call (PagedLaunch in cuda/include/jax_flash/paged_params.h);
    the CPU kernel ignores it.

    kernel: "auto" (the tensor-core kernel where it takes the call, else the CUDA-core one),
    "cuda_core" or "tensor_core" (a call it does not take is an error); pdl / merge_pdl: the
    tensor-core kernel / the split-KV merge as programmatic dependent launches (sm_90+)."""

    kernel: str = "auto"
    pdl: bool = True
    merge_pdl: bool = True


@functools.cache
def default_launch() -> PagedLaunch:
    """The launch options of calls that name none, from the environment (read once, here
    only): JAX_FLASH_PAGED_MMA="0" runs the CUDA-core kernel ("1", as unset: the tensor-core
    kernel wherever it takes the call), JAX_FLASH_PAGED_PDL="0" launches the tensor-core kernel
    without programmatic dependent launch."""
    mma = os.environ.get("JAX_FLASH_PAGED_MMA")
    return PagedLaunch(
        kernel="cuda_core" if mma == "0" else "auto",
        pdl=os.environ.get("JAX_FLASH_PAGED_PDL") != "0",
    )


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    softmax_scale: float
    softcap: float
    window_left: int
    window_right: int
    num_splits: int
    scale_mode: int
    implementation: str | None
    # Private: the launch options (tests pick the kernel through it); default_launch() unless set.
    _launch: PagedLaunch = dataclasses.field(default_factory=default_launch)


paged_attention_p = make_primitive("jax_flash_paged_attention")


def _abstract_eval(q, k_pages, v_pages, k_scale, v_scale, block_tables, kv_lens, *, config):
    B, Sq, Hq, _ = q.shape
    Dv = v_pages.shape[3]
    s = config.num_splits
    part_o = (s, B, Sq, Hq, Dv) if s > 1 else (0,)
    part_l = (s, B, Hq, Sq) if s > 1 else (0,)
    return (
        ShapedArray((B, Sq, Hq, Dv), q.dtype),
        ShapedArray((B, Hq, Sq), jnp.float32),
        ShapedArray(part_o, jnp.float32),
        ShapedArray(part_l, jnp.float32),
    )


paged_attention_p.def_abstract_eval(_abstract_eval)


def _attrs(config: PagedConfig) -> dict:
    return {
        "softmax_scale": np.float32(config.softmax_scale),
        "softcap": np.float32(config.softcap),
        "window_left": np.int32(config.window_left),
        "window_right": np.int32(config.window_right),
        "num_splits": np.int32(config.num_splits),
        "scale_mode": np.int32(config.scale_mode),
        "kernel": np.int32(policy.PAGED_KERNELS[config._launch.kernel]),
        "pdl": np.int32(config._launch.pdl),
        "merge_pdl": np.int32(config._launch.merge_pdl),
    }


# The CUDA kernels' names by policy::PagedChoice (cuda/include/jax_flash/policy/paged.h).
_PAGED_KERNELS = {v: k for k, v in policy.PAGED_CHOICES.items()}


def mma_supported(q_dtype, cache_dtype, scale_mode, head_dim, head_dim_v, cache_shape) -> bool:
    """Whether the tensor-core kernel takes these dtypes and shapes (policy::paged_mma_supported;
    cache_shape: k_pages' [num_pages, page_size, Hkv, D])."""
    num_pages, page_size, hkv = cache_shape[:3]
    return policy.paged_mma_supported(
        jnp.dtype(q_dtype).name, jnp.dtype(cache_dtype).name, scale_mode, head_dim, head_dim_v,
        num_pages, page_size, hkv,
    )  # fmt: skip


def _cuda_kernel(avals_in, config):
    q, k, v = avals_in[:3]
    d, dv = q.shape[3], v.shape[3]
    mma_ok = mma_supported(q.dtype, k.dtype, config.scale_mode, d, dv, k.shape)
    kernel = config._launch.kernel
    choice = _PAGED_KERNELS[policy.paged_kernel_choice(mma_ok, d, dv, policy.PAGED_KERNELS[kernel])]
    if choice == "none":
        asked = "" if kernel == "auto" else f" (kernel {kernel!r} was asked for)"
        return None, (
            f"no CUDA kernel takes q {jnp.dtype(q.dtype).name} with a "
            f"{jnp.dtype(k.dtype).name} cache, D={d}, Dv={dv}{asked}: the tensor-core kernel "
            f"takes float16 / bfloat16 q with D and Dv multiples of 16 up to 256, the CUDA-core "
            f"kernel D == Dv in {policy.PAGED_HEAD_DIMS}"
        )
    return choice, None


def _scales(config, k_scale, v_scale):
    if config.scale_mode == SCALE_NONE:
        return None, None
    return k_scale, v_scale


def _reference(q, k_pages, v_pages, k_scale, v_scale, block_tables, kv_lens, *, config):
    ks, vs = _scales(config, k_scale, v_scale)
    o, lse = reference.paged_attention(
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        k_scale=ks,
        v_scale=vs,
        causal=False,
        softmax_scale=config.softmax_scale,
        sliding_window=(config.window_left, config.window_right),
        logits_soft_cap=config.softcap,
        return_lse=True,
    )
    shapes = _abstract_eval(
        q, k_pages, v_pages, k_scale, v_scale, block_tables, kv_lens, config=config
    )[2:]
    return [o, lse] + [jnp.zeros(a.shape, a.dtype) for a in shapes]


def scale_dims(scale_mode: int) -> list[str]:
    """The k/v scales' dims in a cache's sharding rule: none ([0] each, a factor of its own),
    per kv head, or per token and kv head."""
    if scale_mode == SCALE_NONE:
        return ["zk", "zv"]
    return ["h" if scale_mode == SCALE_PER_HEAD else "p n h"] * 2


def _rule(config, shapes_in, shapes_out):
    # Sequences (b) and kv heads (h, with their q heads h*g + j) are independent: batch and
    # head sharding need no communication. Page ids in the block tables are global, so the
    # pool's pages (p), a page's rows (n) and the block tables' columns (m) stay whole, as do
    # a sequence's query rows (s: the causal mask counts them), head dims and the splits (c).
    hq, hkv = shapes_in[0][2], shapes_in[1][2]
    ops = ["b s (h g) d", "p n h d", "p n h e", *scale_dims(config.scale_mode), "b m", "b"]
    part = ["c b s (h g) e", "c b (h g) s"] if config.num_splits > 1 else ["zo", "zl"]
    return make_rule(
        ops, ["b s (h g) e", "b (h g) s", *part], shapes_in, shapes_out,
        whole=("s", "p", "n", "m", "d", "e", "c"), sizes={"g": hq // hkv},
    )  # fmt: skip


register_lowerings(
    paged_attention_p, "paged_attention", _attrs, _reference, _cuda_kernel,
    partitioning=Partitioning(_rule),
)  # fmt: skip


def _batch(args, dims, *, config):
    q, kp, vp, ks, vs, bt, kl = args
    qd, kpd, vpd, ksd, vsd, btd, kld = dims
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
    cache_mapped = any(d is not NOT_MAPPED for d in (kpd, vpd, ksd, vsd))

    if not cache_mapped and btd is NOT_MAPPED and kld is NOT_MAPPED:
        # Only q is mapped: more query heads over the same sequences (a larger GQA group).
        qm = jnp.moveaxis(q, qd, 3)  # [B, Sq, Hq, N, D]
        B, Sq, Hq = qm.shape[:3]
        out = paged_attention_p.bind(
            qm.reshape(B, Sq, Hq * size, qm.shape[4]), kp, vp, ks, vs, bt, kl, config=config
        )
        o = out[0].reshape(B, Sq, Hq, size, -1)
        lse = out[1].reshape(B, Hq, size, Sq)
        return _with_scratch((o, lse), (3, 2))

    config_b = config
    if cache_mapped:
        # Each instance has its own cache: stack the caches' pages and shift the page ids of
        # instance n by n * num_pages (ids out of range stay out of range).
        kpm, vpm = batch_first(kp, kpd, size), batch_first(vp, vpd, size)
        P = kpm.shape[1]
        kp, vp = kpm.reshape(size * P, *kpm.shape[2:]), vpm.reshape(size * P, *vpm.shape[2:])
        if config.scale_mode == SCALE_PER_HEAD and (ksd is not NOT_MAPPED or vsd is not NOT_MAPPED):
            # Per-instance per-head scales become per-token scales of the stacked pages.
            page = kpm.shape[2]
            ks, vs = (
                jnp.broadcast_to(
                    batch_first(s, d, size)[:, None, None, :], (size, P, page, s.shape[-1])
                ).reshape(size * P, page, -1)
                for s, d in ((ks, ksd), (vs, vsd))
            )
            config_b = dataclasses.replace(config, scale_mode=SCALE_PER_TOKEN)
        elif config.scale_mode == SCALE_PER_TOKEN:
            ks = batch_first(ks, ksd, size).reshape(size * P, *ks.shape[-2:])
            vs = batch_first(vs, vsd, size).reshape(size * P, *vs.shape[-2:])
        btm = batch_first(bt, btd, size)
        off = (jnp.arange(size, dtype=jnp.int32) * P)[:, None, None]
        btm = jnp.where((btm >= 0) & (btm < P), btm + off, -1)
    else:
        btm = batch_first(bt, btd, size)
    B = btm.shape[1]
    qm = batch_first(q, qd, size)
    out = paged_attention_p.bind(
        qm.reshape(size * B, *qm.shape[2:]),
        kp,
        vp,
        ks,
        vs,
        btm.reshape(size * B, btm.shape[2]),
        batch_first(kl, kld, size).reshape(size * B),
        config=config_b,
    )
    o = out[0].reshape(size, B, *out[0].shape[1:])
    lse = out[1].reshape(size, B, *out[1].shape[1:])
    return _with_scratch((o, lse), (0, 0))


def _with_scratch(outs, dims):
    # The split scratch is internal: under vmap it is returned unbatched and unused.
    return list(outs) + [jnp.zeros((0,), jnp.float32)] * 2, list(dims) + [NOT_MAPPED] * 2


batching.primitive_batchers[paged_attention_p] = _batch
