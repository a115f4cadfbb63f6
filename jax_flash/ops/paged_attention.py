"""Decode attention against a paged KV cache: `paged_attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import reference
from ..primitives.paged_attention import (
    SCALE_NONE,
    SCALE_PER_HEAD,
    SCALE_PER_TOKEN,
    PagedConfig,
    PagedLaunch,
    default_launch,
    mma_supported,
    paged_attention_p,
    policy,
)
from . import _checks

_OP = "paged_attention"
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
_DEFAULT_SM_COUNT = 132  # when the device does not say (an H100 SXM has 132 SMs)


def check_cache(op, k_pages, v_pages, k_scale, v_scale, head_dim=None, dtype=None):
    """Checks a paged cache and its scales; returns the scale mode."""
    _checks.array_arg(op, "k_pages", k_pages, 4, "[num_pages, page_size, Hkv, D]")
    _checks.array_arg(op, "v_pages", v_pages, 4, "[num_pages, page_size, Hkv, Dv]")
    if v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(
            f"{op}: v_pages must have shape {tuple(k_pages.shape[:3]) + ('Dv',)} to match k_pages "
            f"{tuple(k_pages.shape)}, got {tuple(v_pages.shape)}"
        )
    if head_dim is not None and k_pages.shape[3] != head_dim:
        raise ValueError(
            f"{op}: k_pages head dim {k_pages.shape[3]} must equal the queries'/new keys' "
            f"{head_dim}"
        )
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"{op}: v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}")
    quantized = any(k_pages.dtype == d for d in QUANTIZED_DTYPES)
    if not quantized:
        if dtype is not None and k_pages.dtype != dtype:
            raise TypeError(
                f"{op}: an unquantized cache must have the dtype of the queries/new keys "
                f"({dtype}), got k_pages {k_pages.dtype}"
            )
        _checks.float_dtype(op, "k_pages", k_pages)
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{op}: k_scale/v_scale are only for int8 or float8_e4m3fn caches")
        return SCALE_NONE
    if k_scale is None or v_scale is None:
        raise ValueError(f"{op}: a {k_pages.dtype} cache needs k_scale and v_scale (float32)")
    P, page, Hkv = k_pages.shape[:3]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not hasattr(s, "shape") or s.dtype != jnp.float32:
            raise TypeError(f"{op}: {name} must be a float32 array")
    if k_scale.shape != v_scale.shape:
        raise ValueError(
            f"{op}: k_scale {tuple(k_scale.shape)} and v_scale {tuple(v_scale.shape)} differ"
        )
    if tuple(k_scale.shape) == (Hkv,):
        return SCALE_PER_HEAD
    if tuple(k_scale.shape) == (P, page, Hkv):
        return SCALE_PER_TOKEN
    raise ValueError(
        f"{op}: k_scale must have shape ({Hkv},) (per head) or {(P, page, Hkv)} (per token and "
        f"head), got {tuple(k_scale.shape)}"
    )


def _sm_count() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or _DEFAULT_SM_COUNT)


def default_num_splits(
    batch: int,
    num_heads_k: int,
    group: int,
    seqlen_q: int,
    capacity: int,
    head_dim: int = 128,
    mma_ok: bool = False,
    cache_itemsize: int = 2,
    kernel: str | None = None,
    q_itemsize: int = 2,
) -> int:
    """Split count for a CUDA decode call (the CPU kernel splits on its own): the C++ heuristic
    (policy::paged_num_splits in cuda/include/jax_flash/policy/paged.h) for this GPU's SM count.

    The CUDA-core kernel runs one CTA per (sequence, kv head, split, chunk of <= 16 query rows of
    the group); two 4-8-row CTAs (or one 16-row CTA) fit an SM; 16-bit q (`q_itemsize` 2) runs
    16-row CTAs only. The tensor-core kernel (`mma_ok`: it takes the call,
    policy.paged_mma_supported; run unless `kernel` is "cuda_core") runs 16-row CTAs, 2 / 2 / 1
    per SM for tile widths 64 / 128 / 256 (8-bit caches, `cache_itemsize` 1: 3 / 2 / 1;
    `head_dim` is max(D, Dv), whose tile the call runs on). Aim for about one wave: no split if
    the CTAs already fill 80% of the slots, else the largest power of two that fills them, with
    at least 128 keys per split. Measured best on an H100 (132 SMs) for bf16 GQA-4 on the
    CUDA-core kernel's 4-row CTAs (which float32 q runs): B=1 -> 32, 2 -> 16, 4 -> 8, 8 -> 4,
    16 -> 2, >= 32 -> 1. `kernel`: None for the default launch's."""
    kernel = default_launch().kernel if kernel is None else kernel
    mma = policy.paged_use_mma(mma_ok, _kernel_id(kernel))
    return policy.paged_num_splits(
        batch, num_heads_k, group, seqlen_q, capacity, _sm_count(), head_dim, mma,
        cache_itemsize, q_itemsize,
    )  # fmt: skip


def _kernel_id(kernel: str) -> int:
    ids = policy.PAGED_KERNELS
    if kernel not in ids:
        raise ValueError(f"{_OP}: kernel must be one of {sorted(ids)}, got {kernel!r}")
    return ids[kernel]


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
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    _launch: PagedLaunch | None = None,
):
    """Attention of new queries against a paged KV cache (decode, chunked prefill, verification).

    Parameters
    ----------
    q : Array ``[B, Hq, D]`` (one token per sequence) or ``[B, Sq, Hq, D]`` (several: the
        queries are the last ``Sq`` positions of the sequence, already appended to the cache),
        float32, float16 or bfloat16.
    k_pages, v_pages : Array ``[num_pages, page_size, Hkv, D]`` / ``[..., Dv]``; q's dtype, or
        int8 / float8_e4m3fn with ``k_scale``/``v_scale``. Any ``page_size >= 1``.
    block_tables : int32 ``[B, max_pages]``: token ``t`` of sequence ``b`` lives in page
        ``block_tables[b, t // page_size]`` at offset ``t % page_size``.
    kv_lens : int32 ``[B]``: tokens in each sequence's cache (including the ``Sq`` new ones).
    k_scale, v_scale : float32 ``[Hkv]`` (per head) or ``[num_pages, page_size, Hkv]`` (per token
        and head), for quantized pages only (value = stored * scale).
    causal : bool
        For ``Sq > 1``: query ``i`` sees cache positions ``<= kv_len - Sq + i``. No effect for one
        query (it sees the whole cache).
    softmax_scale, sliding_window, logits_soft_cap : as :func:`jax_flash.flash_attention`.
    num_splits : int or None
        Split-KV (FlashDecoding): each sequence's keys are cut into this many chunks attended in
        parallel and merged by their LSE. None picks from the shapes and the GPU's SM count; a
        fixed value gives bit-identical results run to run. The CPU kernel splits on its own.
    return_lse : bool
        Also return ``lse`` float32 ``[B, Hq]`` (or ``[B, Hq, Sq]``).
    implementation : None, "cuda", "cpu" or "xla" (gathers the pages, then the jnp reference).
        On CUDA, float16 / bfloat16 q runs the tensor-core kernel for D and Dv multiples of 16
        up to 256 (D != Dv too); float32 q (or ``_launch`` asking for the CUDA-core kernel)
        runs the CUDA-core kernel, which takes D == Dv in (64, 128, 256). A call no CUDA kernel
        takes runs the "xla" path under None (slow: it gathers the cache) with a
        ``jax_flash.NativeFallbackWarning``, and raises a ValueError under "cuda".
        :func:`jax_flash.kernel_for` tells which kernel a call runs.
    _launch : private: how the CUDA kernels run the call (``PagedLaunch``: which kernel, PDL);
        None for the defaults (``JAX_FLASH_PAGED_MMA``, ``JAX_FLASH_PAGED_PDL``). Tests use it
        to run both kernels in one process.

    Returns
    -------
    o : Array like ``q`` (last dim Dv). ``kv_lens[b] == 0`` gives zeros. A sequence with bad
        device data — ``kv_lens[b] < 0`` or above ``max_pages * page_size``, or a page id outside
        ``[0, num_pages)`` among the pages its length uses — gets NaN in ``o`` and ``lse``; the
        kernels never read through such an id. :func:`jax_flash.check_paged_inputs` reports the
        bad entry under ``jax.experimental.checkify``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> k_pages = jnp.zeros((64, 16, 2, 128), jnp.bfloat16)  # 64 pages of 16 tokens
    >>> v_pages = jnp.zeros((64, 16, 2, 128), jnp.bfloat16)
    >>> block_tables = jnp.arange(64, dtype=jnp.int32).reshape(4, 16)
    >>> kv_lens = jnp.array([1, 17, 200, 0], jnp.int32)
    >>> q = jnp.ones((4, 8, 128), jnp.bfloat16)  # one new token, 8 query heads
    >>> jax_flash.paged_attention(q, k_pages, v_pages, block_tables, kv_lens).shape
    (4, 8, 128)
    """
    if not hasattr(q, "ndim") or q.ndim not in (3, 4):
        raise ValueError(
            f"{_OP}: q must be [B, Hq, D] or [B, Sq, Hq, D], got "
            f"{getattr(q, 'shape', type(q).__name__)}"
        )
    single = q.ndim == 3
    q4 = q[:, None] if single else q
    _checks.float_dtype(_OP, "q", q4)
    B, Sq, Hq, D = q4.shape
    mode = check_cache(_OP, k_pages, v_pages, k_scale, v_scale, head_dim=D, dtype=q4.dtype)
    page_size, Hkv, Dv = k_pages.shape[1], *v_pages.shape[2:]
    _checks.heads(_OP, Hq, Hkv)
    _checks.array_arg(_OP, "block_tables", block_tables, 2, "[B, max_pages]")
    if block_tables.shape[0] != B or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(
            f"{_OP}: block_tables must be an integer array [B={B}, max_pages], got "
            f"{tuple(block_tables.shape)} {block_tables.dtype}"
        )
    block_tables = block_tables.astype(jnp.int32)
    kv_lens = _checks.int_vector(_OP, "kv_lens", kv_lens, B)
    window = reference.normalize_window(causal, sliding_window, _OP)
    scale, cap = _checks.scale_and_cap(_OP, D, softmax_scale, logits_soft_cap)
    _checks.implementation(_OP, implementation)
    max_pages = block_tables.shape[1]
    launch = default_launch() if _launch is None else _launch
    if not isinstance(launch, PagedLaunch):
        raise TypeError(f"{_OP}: _launch must be a PagedLaunch, got {type(launch).__name__}")
    _kernel_id(launch.kernel)
    mma_ok = mma_supported(q4.dtype, k_pages.dtype, mode, D, Dv, k_pages.shape)
    if launch.kernel == "tensor_core" and not mma_ok:
        raise ValueError(
            f"{_OP}: the tensor-core kernel was asked for, but it does not take q "
            f"{jnp.dtype(q4.dtype).name} with a {jnp.dtype(k_pages.dtype).name} cache, "
            f"D={D}, Dv={Dv}, {k_pages.shape[0]} pages of {page_size} x {Hkv} heads (it takes "
            f"float16 / bfloat16 q with a cache of q's dtype or a scaled int8 / float8_e4m3fn "
            f"cache, D and Dv multiples of 16 up to 256, 1 to 2^32 - 1 cache rows)"
        )
    if num_splits is None:
        num_splits = default_num_splits(
            B, Hkv, Hq // Hkv, Sq, max_pages * page_size, head_dim=max(D, Dv), mma_ok=mma_ok,
            cache_itemsize=jnp.dtype(k_pages.dtype).itemsize, kernel=launch.kernel,
            q_itemsize=jnp.dtype(q4.dtype).itemsize,
        )  # fmt: skip
    elif int(num_splits) < 1:
        raise ValueError(f"{_OP}: num_splits must be >= 1, got {num_splits}")
    num_splits = int(min(int(num_splits), max(1, max_pages)))

    if implementation == "xla":
        o, lse = reference.paged_attention(
            q4, k_pages, v_pages, block_tables, kv_lens,
            k_scale=k_scale, v_scale=v_scale, causal=causal, softmax_scale=scale,
            sliding_window=sliding_window, logits_soft_cap=cap, return_lse=True,
        )  # fmt: skip
    elif B == 0 or Hq == 0:
        o = jnp.zeros((B, Sq, Hq, Dv), q.dtype)
        lse = jnp.full((B, Hq, Sq), -jnp.inf, jnp.float32)
    else:
        empty = jnp.zeros((0,), jnp.float32)
        config = PagedConfig(
            scale, cap, window[0], window[1], num_splits, mode, implementation, launch
        )
        o, lse, _, _ = paged_attention_p.bind(
            q4,
            k_pages,
            v_pages,
            empty if k_scale is None else k_scale,
            empty if v_scale is None else v_scale,
            block_tables,
            kv_lens,
            config=config,
        )
    if single:
        o, lse = o[:, 0], lse[..., 0]
    return (o, lse) if return_lse else o
