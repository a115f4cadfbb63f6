"""The implementations each benchmark compares jax_flash with, on this platform: on GPU cuDNN,
XLA, JAX Pallas, the FlashAttention-3 binding and tokamax (when installed) and the jnp
reference; on CPU XLA and the jnp reference. The prefill, decode and backward grids each have
their peers here. A peer that cannot run a shape is given as a string saying why."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import reference
from jax_flash.bench.report import error_text
from jax_flash.bench.shapes import DecodeShape, PrefillShape

MATERIALISING = ("xla_dpa", "jnp_reference")  # prefill peers that build the S x S scores


def skipped(name: str, skip) -> bool:
    """Whether --skip names this peer (or a prefix of its name: "pallas" skips pallas_k*)."""
    return name != "jax_flash" and any(name.startswith(x) for x in skip)


def prefill_peers(device_kind: str, s: PrefillShape):
    """name -> fn(q, k, v) for every implementation that applies on this platform."""
    peers = {
        "jax_flash": functools.partial(jax_flash.flash_attention, causal=s.causal),
    }
    if device_kind == "gpu":
        peers["cudnn"] = functools.partial(
            jax.nn.dot_product_attention, is_causal=s.causal, implementation="cudnn"
        )
        try:
            from jax.experimental.pallas.ops.gpu import attention as pallas_attention
        except ImportError:
            pallas_attention = None
        if pallas_attention is not None:

            def pallas_mha(q, k, v):
                g = s.heads_q // s.heads_kv
                if g > 1:  # the Pallas kernel has no GQA: repeat K/V heads (inside the timing)
                    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
                return pallas_attention.mha(
                    q, k, v, segment_ids=None, sm_scale=s.head_dim**-0.5, causal=s.causal
                )

            peers["pallas_triton"] = pallas_mha
        peers.update(_optional_prefill_peers(s))
    peers["xla_dpa"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=s.causal, implementation="xla"
    )
    peers["jnp_reference"] = functools.partial(
        jax_flash.flash_attention, causal=s.causal, implementation="xla"
    )
    return peers


def _optional_prefill_peers(s: PrefillShape):
    """Prefill peers from optional packages, when importable: the FlashAttention-3 binding for
    JAX (flash-attn3-jax, Hopper only) and tokamax's Mosaic GPU attention."""
    peers = {}
    try:
        from flash_attn3_jax import flash_mha
    except ImportError:
        flash_mha = None
    if flash_mha is not None:
        peers["fa3"] = functools.partial(
            flash_mha, softmax_scale=s.head_dim**-0.5, is_causal=s.causal
        )
    try:
        import tokamax
    except ImportError:
        tokamax = None
    if tokamax is not None:
        peers["tokamax_mosaic"] = functools.partial(
            tokamax.dot_product_attention, is_causal=s.causal, implementation="mosaic"
        )
    return peers


def decode_peers(kind, s: DecodeShape, mem: float):
    """[(make_args, {name: fn, or a string saying why it does not run})]: make_args(data)
    builds the group's arguments from decode.make_paged's (a peer's own copy of the cache,
    dropped after the group). Every fn is fn(q, k, v, block_tables, kv_lens, k_scale, v_scale)
    -> o on arguments in its own layout."""

    def jf(q, kp, vp, bt, kl, ks, vs):
        return jax_flash.paged_attention(q, kp, vp, bt, kl, k_scale=ks, v_scale=vs)

    def gather(q, kp, vp, bt, kl, ks, vs):
        return jax_flash.paged_attention(
            q, kp, vp, bt, kl, k_scale=ks, v_scale=vs, implementation="xla"
        )

    same = lambda data: data  # noqa: E731
    groups = [(same, {"jax_flash": jf})]
    if kind == "gpu":
        groups.append(_pallas_group(s))
        groups.append(_cudnn_group(s))
        groups.append(_pallas_decode_group(s))
        groups.append(_fa3_paged_group(s))
    if 1.5 * s.gather_bytes > 0.5 * mem:
        gather = (
            f"skipped: the float32 dense copy of the cache needs ~{s.gather_bytes / 2**30:.0f} "
            f"GiB (over half of the {mem / 2**30:.0f} GiB this process may allocate)"
        )
    groups.append((same, {"jnp_gather": gather}))
    return groups


def _pallas_group(s: DecodeShape):
    """JAX Pallas (Triton) paged_attention at k_splits 1/4/16 on a head-major copy of the cache
    ([Hkv, pages, page_size, D], scales [Hkv, pages, page_size]: per-head scales are repeated
    per token, the only scale layout it takes) and q scaled by 1/sqrt(D)."""
    names = [f"pallas_k{k}" for k in (1, 4, 16)]
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
    except ImportError as e:
        return (None, dict.fromkeys(names, f"unavailable: {error_text(e)}"))
    if s.seqlen_q != 1:
        why = "unsupported: Pallas paged_attention takes one query per sequence (q [B, Hq, D])"
        return (None, dict.fromkeys(names, why))

    @jax.jit
    def head_major(data):
        q, kp, vp, bt, kl, ks, vs = data
        kh, vh = (jnp.transpose(x, (2, 0, 1, 3)) for x in (kp, vp))
        if ks is not None and ks.ndim == 1:  # per head
            ks, vs = (jnp.broadcast_to(x[:, None, None], kh.shape[:3]) for x in (ks, vs))
        elif ks is not None:
            ks, vs = (jnp.transpose(x, (2, 0, 1)) for x in (ks, vs))
        # The Pallas kernel applies no softmax scale: fold 1/sqrt(D) into q (outside the timing,
        # as a model would fold it into the query projection).
        q = (q.astype(jnp.float32) * s.head_dim**-0.5).astype(q.dtype)
        return q, kh, vh, bt, kl, ks, vs

    pages_per_seq = -(-s.ctx // s.page_size)
    peers = {}
    for splits, name in zip((1, 4, 16), names, strict=True):
        if pages_per_seq % splits:
            peers[name] = f"unsupported: {pages_per_seq} pages per sequence % k_splits {splits}"
            continue
        # about 128 tokens per compute block, dividing the pages of one split
        ppcb = math.gcd(max(1, 128 // s.page_size), pages_per_seq // splits)

        def fn(q, kh, vh, bt, kl, ks, vs, splits=splits, ppcb=ppcb):
            return pallas_paged.paged_attention(
                q, kh, vh, bt, kl, ks, vs, k_splits=splits, pages_per_compute_block=ppcb
            )

        peers[name] = fn
    return (head_major, peers)


def _contiguous_cache(data):
    """The peer arguments with the pages gathered into a contiguous [B, ctx, Hkv, D] cache."""
    q, kp, vp, bt, kl, ks, vs = data
    kd, vd = (reference.gather_pages(x, bt).astype(x.dtype) for x in (kp, vp))
    return q, kd, vd, bt, kl, None, None


def _pallas_decode_group(s: DecodeShape):
    """JAX Pallas (Triton) `decode_attention.gqa` on a contiguous copy of the cache (one query
    token, 16-bit cache): the bound without paging, as cuDNN's. k_splits 16 (its default), fewer
    where a split would hold less than one 128-key block."""
    name = "pallas_decode_contiguous"
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention
    except ImportError as e:
        return (None, {name: f"unavailable: {error_text(e)}"})
    if s.seqlen_q != 1 or s.quantized:
        return (None, {name: "unsupported: one query token and a 16-bit cache only"})
    splits = 16
    while splits > 1 and (s.ctx % splits or (s.ctx // splits) % 128):
        splits //= 2
    if s.ctx % 128:
        return (None, {name: f"unsupported: ctx {s.ctx} is not a multiple of its 128-key block"})

    def fn(q, kd, vd, bt, kl, ks, vs):
        return decode_attention.gqa(
            q, kd, vd, kv_seq_len=kl, sm_scale=s.head_dim**-0.5, k_splits=splits
        )

    return (jax.jit(_contiguous_cache), {name: fn})


def _fa3_paged_group(s: DecodeShape):
    """The FlashAttention-3 binding's paged decode (`flash_attn3_jax.flash_mha_with_kvcache`,
    the cache as it is, page_table = block tables) at num_splits 1 and 8 (fa3_paged_best: the
    faster), 16-bit caches."""
    names = [f"fa3_paged_s{n}" for n in (1, 8)]
    try:
        from flash_attn3_jax import flash_mha_with_kvcache
    except ImportError as e:
        return (None, dict.fromkeys(names, f"unavailable: {error_text(e)}"))
    if s.quantized:
        return (None, dict.fromkeys(names, "unsupported: a 16-bit cache only"))
    peers = {}
    for splits, name in zip((1, 8), names, strict=True):

        def fn(q, kp, vp, bt, kl, ks, vs, splits=splits):
            q4 = q[:, None] if q.ndim == 3 else q
            o = flash_mha_with_kvcache(
                q4, kp, vp, cache_seqlens=kl, page_table=bt, is_causal=True,
                softmax_scale=s.head_dim**-0.5, num_splits=splits,
            )  # fmt: skip
            return o[:, 0] if q.ndim == 3 else o

        peers[name] = fn
    return (lambda data: data, peers)


def _cudnn_group(s: DecodeShape):
    """cuDNN (jax.nn.dot_product_attention) on a contiguous [B, ctx, Hkv, D] copy of the cache:
    the bound without paging."""
    name = "cudnn_contiguous"
    if s.quantized:
        return (None, {name: "unsupported: cuDNN attention here takes a bf16/fp16 cache only"})

    @jax.jit
    def contiguous(data):
        q, kp, vp, bt, kl, ks, vs = data
        kd, vd = (reference.gather_pages(x, bt).astype(x.dtype) for x in (kp, vp))
        return q, kd, vd, bt, kl, None, None

    def cudnn(q, kd, vd, bt, kl, ks, vs):
        q4 = q[:, None] if q.ndim == 3 else q
        # Sq > 1: no mask (cuDNN's causal mask is top-left aligned, the cache's bottom-right)
        o = jax.nn.dot_product_attention(q4, kd, vd, implementation="cudnn")
        return o[:, 0] if q.ndim == 3 else o

    return (contiguous, {name: cudnn})


def backward_peers(device_kind: str, s: PrefillShape):
    """name -> differentiable fn(q, k, v) -> o (or a string saying why it does not run) for the
    backward grid: jax_flash in its fast and deterministic modes, and on GPU cuDNN, the FA3
    binding (flash_attn3_jax), JAX Pallas (Triton) `mha` and tokamax (Mosaic) where importable;
    on CPU XLA."""
    peers = {
        "jax_flash": functools.partial(jax_flash.flash_attention, causal=s.causal),
        "jax_flash_det": functools.partial(
            jax_flash.flash_attention, causal=s.causal, deterministic=True
        ),
    }
    if device_kind != "gpu":
        peers["xla_dpa"] = functools.partial(
            jax.nn.dot_product_attention, is_causal=s.causal, implementation="xla"
        )
        return peers
    peers["cudnn"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=s.causal, implementation="cudnn"
    )
    try:
        from flash_attn3_jax import flash_mha

        peers["fa3"] = functools.partial(flash_mha, is_causal=s.causal)
    except ImportError as e:
        peers["fa3"] = f"unavailable: {error_text(e)}"
    pallas = prefill_peers(device_kind, s).get("pallas_triton")
    if pallas is not None:
        peers["pallas_triton"] = pallas
    try:
        import tokamax

        peers["tokamax"] = functools.partial(
            tokamax.dot_product_attention, is_causal=s.causal, implementation="mosaic"
        )
    except ImportError as e:
        peers["tokamax"] = f"unavailable: {error_text(e)}"
    return peers
