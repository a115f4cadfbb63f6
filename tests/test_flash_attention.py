"""flash_attention / flash_attention_varlen against jax_flash.reference, on every platform."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference
from jax_flash.primitives import _common

from _util import DTYPES, randn, rel_err, tolerance


def _cpu(*xs):
    cpu = jax.devices("cpu")[0]
    return [jax.device_put(x, cpu) for x in xs]


def _assert_lse(lse, ref_lse, dtype):
    lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
    empty = np.isneginf(ref_lse)
    assert not np.any(np.isnan(lse)), "lse holds NaN"
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="lse -inf pattern differs")
    atol = tolerance(dtype, 0.0)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=atol, atol=atol)


def _dense_case(platform, rng, B, Sq, Skv, Hq, Hkv, D, dtype, Dv=None, jit=True, **opts):
    dtype = DTYPES[dtype]
    Dv = D if Dv is None else Dv
    q = randn(rng, (B, Sq, Hq, D), dtype)
    k = randn(rng, (B, Skv, Hkv, D), dtype)
    v = randn(rng, (B, Skv, Hkv, Dv), dtype)
    fn = functools.partial(
        jax_flash.flash_attention, return_lse=True, implementation=platform.name, **opts
    )
    args = platform.put(q, k, v)
    extra = {n: platform.put(opts[n]) for n in ("q_seqlens", "kv_seqlens") if n in opts}
    if extra:
        fn = functools.partial(fn, **extra)
    o, lse = (jax.jit(fn) if jit else fn)(*args)
    assert o.shape == (B, Sq, Hq, Dv) and o.dtype == dtype
    assert lse.shape == (B, Hq, Sq) and lse.dtype == jnp.float32
    q, k, v = _cpu(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]  # the same values, an unrounded output
    ref_o, ref_lse = reference.attention(*f32, return_lse=True, **opts)
    same_dtype = reference.attention(q, k, v, compute_dtype=dtype, **opts)
    tol = tolerance(dtype, rel_err(same_dtype, ref_o))
    err = rel_err(o, ref_o)
    assert err <= tol, f"relative error {err:.3g} > tolerance {tol:.3g}"
    _assert_lse(lse, ref_lse, dtype)
    return np.asarray(o, np.float32), np.asarray(lse)


# (B, Sq, Skv, Hq, Hkv, D): odd sizes, GQA groups 1, 3, 5, 7, 8.
SHAPES = [
    (2, 1, 1, 1, 1, 64),
    (3, 7, 7, 6, 2, 64),
    (2, 97, 97, 10, 2, 128),
    (1, 61, 61, 7, 7, 256),
    (1, 1000, 1000, 8, 1, 64),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense(platform, rng, shape, causal, dtype):
    _dense_case(platform, rng, *shape, dtype, causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_long_sequence(platform, rng, dtype):
    _dense_case(platform, rng, 1, 1031, 1031, 4, 2, 128, dtype, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,skv", [(37, 97), (97, 37), (1, 300), (5, 1)])
def test_unequal_lengths(platform, rng, sq, skv, causal):
    # Bottom-right causal: with Sq > Skv the first Sq - Skv rows see no key (zeros, lse -inf).
    o, lse = _dense_case(platform, rng, 2, sq, skv, 4, 2, 64, "bfloat16", causal=causal)
    if causal and sq > skv:
        assert np.all(o[:, : sq - skv] == 0)
        assert np.all(np.isneginf(lse[:, :, : sq - skv]))


@pytest.mark.parametrize(
    "window,causal",
    [
        ((16, 0), False),
        ((16, None), True),
        ((8, 8), False),
        ((None, 5), False),
        ((0, 0), False),
        ((3, -1), False),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_window(platform, rng, window, causal, dtype):
    _dense_case(platform, rng, 2, 97, 131, 6, 3, 64, dtype, sliding_window=window, causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_soft_cap_and_scale(platform, rng, dtype):
    _dense_case(
        platform,
        rng,
        2,
        67,
        67,
        4,
        4,
        128,
        dtype,
        causal=True,
        logits_soft_cap=5.0,
        softmax_scale=0.3,
    )


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("d,dv", [(64, 128), (128, 64), (96, 96), (80, 48)])
def test_head_dims(platform, rng, d, dv, dtype):
    _dense_case(platform, rng, 2, 45, 53, 4, 2, d, dtype, Dv=dv, causal=True)


# Head dims of real models on the tensor-core kernels (16-bit): their tiles run every multiple
# of 16 (policy::flash_mma_tile_dim: 64 / 128 / 256; on Hopper flash_hopper_tile_dim adds 192
# and the 128 tile computing 80 / 96 / 112 columns),
# D != Dv too; the padded variants are checked with and without softcap, causal and not. On CUDA
# the call must run a tensor-core kernel.
@pytest.mark.parametrize(
    "d,dv,dtype,opts",
    [
        (16, 16, "bfloat16", {"causal": True}),
        (32, 32, "float16", {"causal": False}),
        (80, 80, "bfloat16", {"causal": True}),
        (80, 80, "float16", {"causal": True, "logits_soft_cap": 5.0}),
        (96, 96, "bfloat16", {"causal": False}),
        (112, 112, "float16", {"causal": True}),
        (144, 144, "bfloat16", {"causal": True, "logits_soft_cap": 5.0}),
        (160, 160, "bfloat16", {"causal": True}),
        (192, 192, "float16", {"causal": False}),
        (192, 128, "bfloat16", {"causal": True}),
        (128, 64, "float16", {"causal": False, "sliding_window": (20, 3)}),
        (48, 208, "bfloat16", {"causal": True}),
    ],
    ids=str,
)
def test_tensor_core_head_dims(platform, rng, d, dv, dtype, opts):
    if platform.name == "cuda":
        q = jax.ShapeDtypeStruct((2, 97, 6, d), DTYPES[dtype])
        k = jax.ShapeDtypeStruct((2, 131, 2, d), DTYPES[dtype])
        v = jax.ShapeDtypeStruct((2, 131, 2, dv), DTYPES[dtype])
        ran = jax_flash.kernel_for(jax_flash.flash_attention, q, k, v, platform="cuda", **opts)
        assert ran == "cuda:tensor_core", ran
    _dense_case(platform, rng, 2, 97, 131, 6, 2, d, dtype, Dv=dv, **opts)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_padding(platform, rng, dtype, causal):
    B, Sq, Skv = 5, 97, 113
    q_len = np.array([0, 1, 97, 50, 200], np.int32)  # 200 is clipped to Sq
    kv_len = np.array([113, 0, 60, 7, 113], np.int32)
    o, lse = _dense_case(
        platform,
        rng,
        B,
        Sq,
        Skv,
        6,
        2,
        64,
        dtype,
        causal=causal,
        q_seqlens=jnp.asarray(q_len),
        kv_seqlens=jnp.asarray(kv_len),
    )
    for b in range(B):
        n = min(q_len[b], Sq)
        assert np.all(o[b, n:] == 0), "padding rows must be exactly zero"
        assert np.all(np.isneginf(lse[b, :, n:]))
    assert np.all(o[1] == 0), "a sequence with no keys gives zeros"


@pytest.mark.parametrize("causal", [False, True])
def test_lse_without_value_columns(platform, rng, causal):
    # Dv = 0: o is empty, but lse is still the logsumexp of the scaled scores (-inf for rows
    # that see no key, including padding rows and rows no sequence owns).
    B, Sq, Skv, Hq, Hkv, D = 3, 37, 45, 6, 2, 64
    q = randn(rng, (B, Sq, Hq, D), jnp.float32)
    k = randn(rng, (B, Skv, Hkv, D), jnp.float32)
    q_len = jnp.asarray([37, 20, 0], jnp.int32)
    kv_len = jnp.asarray([45, 0, 9], jnp.int32)
    fn = functools.partial(
        jax_flash.flash_attention, causal=causal, return_lse=True, implementation=platform.name
    )
    v0 = jnp.zeros((B, Skv, Hkv, 0), jnp.float32)
    args = platform.put(q, k, v0, q_len, kv_len)
    o, lse = jax.jit(fn)(*args[:3], q_seqlens=args[3], kv_seqlens=args[4])
    assert o.shape == (B, Sq, Hq, 0)
    v1 = jnp.zeros((B, Skv, Hkv, 1), jnp.float32)  # lse does not depend on v
    _, ref_lse = reference.attention(
        q, k, v1, causal=causal, q_seqlens=q_len, kv_seqlens=kv_len, return_lse=True
    )
    _assert_lse(lse, ref_lse, jnp.float32)
    # Packed rows that no sequence owns.
    cu = jnp.asarray([0, 30, 41], jnp.int32)
    qv, kv = randn(rng, (50, Hq, D), jnp.float32), randn(rng, (41, Hkv, D), jnp.float32)
    _, lse = jax.jit(
        functools.partial(
            jax_flash.flash_attention_varlen, return_lse=True, implementation=platform.name
        )
    )(*platform.put(qv, kv, jnp.zeros((41, Hkv, 0), jnp.float32), cu, cu))
    lse = np.asarray(lse)
    assert np.all(np.isneginf(lse[:, 41:])) and np.all(np.isfinite(lse[:, :41]))


# A key that some rows cannot see although other rows of their key tile can: beyond their causal
# limit, or outside their sliding window. `seen`: the rows that see it.
@pytest.mark.parametrize(
    "opts,key,seen",
    [({"causal": True}, 20, slice(20, 37)), ({"sliding_window": (4, 0)}, 3, slice(3, 8))],
    ids=["causal", "window"],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_masked_nonfinite_value_contributes_nothing(
    platform, rng, request, opts, key, seen, bad, dtype
):
    if platform.name == "cuda":
        request.applymarker(
            pytest.mark.xfail(
                reason="CUDA prefill kernels multiply masked keys' v by p = 0 (documented)"
            )
        )
    dtype = DTYPES[dtype]
    B, S, Hq, Hkv, D = 2, 37, 4, 2, 64
    q, k, v = (randn(rng, (B, S, h, D), dtype) for h in (Hq, Hkv, Hkv))
    v_bad = v.at[1, key, 0, 5].set(bad)
    fn = functools.partial(jax_flash.flash_attention, implementation=platform.name, **opts)
    o = np.array(jax.jit(fn)(*platform.put(q, k, v_bad)), np.float32)
    # kv head 0 serves query heads 0 and 1; every row that can see the key is non-finite there.
    assert not np.any(np.isfinite(o[1, seen, :2, 5]))
    # Everything else equals attention over v without the bad value.
    o[1, seen, :2, 5] = 0.0
    q32, k32, v32 = (x.astype(jnp.float32) for x in _cpu(q, k, v))
    ref_o = np.array(reference.attention(q32, k32, v32, **opts))
    ref_o[1, seen, :2, 5] = 0.0
    same = np.array(reference.attention(*_cpu(q, k, v), compute_dtype=dtype, **opts), np.float32)
    same[1, seen, :2, 5] = 0.0
    tol = tolerance(dtype, rel_err(same, ref_o))
    err = rel_err(o, ref_o)
    assert err <= tol, f"relative error {err:.3g} > tolerance {tol:.3g}"


def test_eager_equals_jit(platform, rng):
    q, k, v = (randn(rng, (2, 33, 4, 64), jnp.float16) for _ in range(3))
    q, k, v = platform.put(q, k, v)
    fn = functools.partial(jax_flash.flash_attention, causal=True, implementation=platform.name)
    np.testing.assert_array_equal(np.asarray(fn(q, k, v)), np.asarray(jax.jit(fn)(q, k, v)))
    _dense_case(platform, rng, 2, 33, 33, 4, 2, 64, "float16", jit=False, causal=True)


# vmap: (in_axes of q, k, v, q_seqlens) — only q (folds into heads), all, k/v only, lengths only.
VMAP_AXES = [
    (0, None, None, None),
    (0, 0, 0, None),
    (None, 1, 1, None),
    (2, 0, 0, 0),
    (None, None, None, 0),
]


@pytest.mark.parametrize("in_axes", VMAP_AXES, ids=str)
def test_vmap(platform, rng, in_axes):
    N, B, Sq, Skv, Hq, Hkv, D = 3, 2, 29, 41, 4, 2, 64
    dtype = jnp.float32

    def make(axis, shape, fn):
        if axis is None:
            return fn(shape)
        return jnp.moveaxis(fn((N,) + shape), 0, axis)

    q = make(in_axes[0], (B, Sq, Hq, D), lambda s: randn(rng, s, dtype))
    k = make(in_axes[1], (B, Skv, Hkv, D), lambda s: randn(rng, s, dtype))
    v = make(in_axes[2], (B, Skv, Hkv, D), lambda s: randn(rng, s, dtype))
    ql = make(in_axes[3], (B,), lambda s: jnp.asarray(rng.integers(0, Sq + 1, s), jnp.int32))

    def attn(impl, q, k, v, ql):
        return jax_flash.flash_attention(
            q, k, v, causal=True, q_seqlens=ql, return_lse=True, implementation=impl
        )

    out = jax.jit(jax.vmap(functools.partial(attn, platform.name), in_axes=in_axes))(
        *platform.put(q, k, v, ql)
    )
    ref = jax.vmap(functools.partial(attn, "xla"), in_axes=in_axes)(*_cpu(q, k, v, ql))
    assert rel_err(out[0], ref[0]) <= tolerance(dtype, 0.0)
    _assert_lse(out[1], ref[1], dtype)


def test_nested_vmap(platform, rng):
    q = randn(rng, (2, 3, 1, 17, 4, 64), jnp.float32)
    k = randn(rng, (2, 1, 19, 2, 64), jnp.float32)
    v = randn(rng, (2, 1, 19, 2, 64), jnp.float32)

    def attn(impl):
        f = functools.partial(jax_flash.flash_attention, causal=True, implementation=impl)
        return jax.vmap(jax.vmap(f, in_axes=(0, None, None)), in_axes=(0, 0, 0))

    out = jax.jit(attn(platform.name))(*platform.put(q, k, v))
    ref = attn("xla")(*_cpu(q, k, v))
    assert out.shape == (2, 3, 1, 17, 4, 64)
    assert rel_err(out, ref) <= tolerance(jnp.float32, 0.0)


# ---------------------------------------------------------------------------------------------
# varlen


def _varlen_case(platform, rng, q_lens, k_lens, Hq, Hkv, D, dtype, tail=0, **opts):
    dtype = DTYPES[dtype]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    Tq, Tk = int(cu_q[-1]) + tail, int(cu_k[-1])
    q = randn(rng, (Tq, Hq, D), dtype)
    k = randn(rng, (Tk, Hkv, D), dtype)
    v = randn(rng, (Tk, Hkv, D), dtype)
    fn = functools.partial(
        jax_flash.flash_attention_varlen, return_lse=True, implementation=platform.name, **opts
    )
    o, lse = jax.jit(fn)(*platform.put(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k)))
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert o.shape == (Tq, Hq, D) and lse.shape == (Hq, Tq)
    q, k, v = _cpu(q, k, v)
    # The packed reference (the "xla" implementation), in float32.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    packed_o, packed_lse = jax_flash.flash_attention_varlen(
        *f32, jnp.asarray(cu_q), jnp.asarray(cu_k), implementation="xla", return_lse=True, **opts
    )
    # Each sequence alone through the dense reference.
    for b in range(len(q_lens)):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        args = (q[None, qs:qe], k[None, ks:ke], v[None, ks:ke])
        args32 = [x.astype(jnp.float32) for x in args]
        ref_o, ref_lse = reference.attention(*args32, return_lse=True, **opts)
        same = reference.attention(*args, compute_dtype=dtype, **opts)
        tol = tolerance(dtype, rel_err(same, ref_o))
        err = rel_err(o[qs:qe], ref_o[0])
        assert err <= tol, f"sequence {b}: relative error {err:.3g} > {tol:.3g}"
        _assert_lse(lse[:, qs:qe], ref_lse[0], dtype)
        assert rel_err(packed_o[qs:qe], ref_o[0]) <= 1e-5
        _assert_lse(packed_lse[:, qs:qe], ref_lse[0], jnp.float32)
    if tail:
        assert np.all(o[Tq - tail :] == 0) and np.all(np.isneginf(lse[:, Tq - tail :]))
        assert np.all(np.asarray(packed_o[Tq - tail :]) == 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(platform, rng, dtype, causal):
    q_lens = [0, 1, 7, 97, 300, 5]
    k_lens = [3, 1, 20, 97, 250, 0]
    _varlen_case(platform, rng, q_lens, k_lens, 6, 2, 64, dtype, tail=9, causal=causal)


@pytest.mark.parametrize(
    "opts",
    [
        dict(sliding_window=(32, 0)),
        dict(logits_soft_cap=3.0, softmax_scale=0.2),
        dict(causal=True, sliding_window=(5, None)),
    ],
    ids=str,
)
def test_varlen_options(platform, rng, opts):
    _varlen_case(platform, rng, [13, 100, 1], [40, 100, 9], 8, 1, 128, "bfloat16", **opts)


def test_varlen_vmap(platform, rng):
    N, Hq, Hkv, D = 3, 4, 2, 64
    cu = jnp.asarray([[0, 5, 20, 26], [0, 1, 2, 3], [0, 30, 30, 30]], jnp.int32)
    q = randn(rng, (N, 32, Hq, D), jnp.float32)
    k = randn(rng, (N, 30, Hkv, D), jnp.float32)
    v = randn(rng, (N, 30, Hkv, D), jnp.float32)

    def attn(impl, q, k, v, cu):
        return jax_flash.flash_attention_varlen(q, k, v, cu, cu, causal=True, implementation=impl)

    out = jax.jit(jax.vmap(functools.partial(attn, platform.name)))(*platform.put(q, k, v, cu))
    ref = jax.vmap(functools.partial(attn, "xla"))(*_cpu(q, k, v, cu))
    assert rel_err(out, ref) <= tolerance(jnp.float32, 0.0)
    assert np.all(np.asarray(out)[:, 30:] == 0)


def test_varlen_garbage_offsets_stay_in_bounds(platform, rng):
    # cu_seqlens are device data: out-of-range and decreasing values are clamped, never followed.
    # (Query ranges that overlap after clamping have no defined result: each overlapped row holds
    # one of the sequences' outputs; this test keeps them apart. Key ranges may overlap.)
    q = randn(rng, (40, 4, 64), jnp.float16)
    k = randn(rng, (30, 2, 64), jnp.float16)
    v = randn(rng, (30, 2, 64), jnp.float16)
    cu_q = jnp.asarray([5, -3, 2, 20, 2**31 - 1], jnp.int32)
    cu_k = jnp.asarray([0, 2**30, -3, 12, 30], jnp.int32)
    fn = functools.partial(jax_flash.flash_attention_varlen, causal=True, return_lse=True)
    o, lse = jax.jit(functools.partial(fn, implementation=platform.name))(
        *platform.put(q, k, v, cu_q, cu_k)
    )
    ref_o, ref_lse = fn(*_cpu(q, k, v, cu_q, cu_k), implementation="xla")
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    assert rel_err(o, ref_o) <= tolerance(jnp.float16, 2e-3)
    _assert_lse(lse, ref_lse, jnp.float16)


# ---------------------------------------------------------------------------------------------
# API


def test_xla_implementation_is_reference(rng):
    q, k, v = (randn(rng, (2, 9, 4, 32), jnp.float32) for _ in range(3))
    out = jax_flash.flash_attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_array_equal(out, reference.attention(q, k, v, causal=True))


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_reference_rounds_as_op_by_op(rng, dtype, softcap):
    # Outside a transformation the reference runs as one jitted computation (one compile per
    # shape) with XLA's excess precision off, so that a same-dtype run still rounds every step
    # to its dtype: it equals op-by-op execution bit for bit (the tolerances of every test scale
    # with that run's error), but for the soft cap's tanh, which XLA's fused code computes
    # within an ulp or two of the standalone op's.
    dt = DTYPES[dtype]
    q = randn(rng, (2, 37, 4, 32), dt)
    k, v = (randn(rng, (2, 53, 2, 32), dt) for _ in range(2))
    lens = jnp.asarray([53, 20], jnp.int32)
    opts = dict(causal=True, logits_soft_cap=softcap, return_lse=True)
    cu = jnp.asarray([0, 37, 74], jnp.int32)
    packed = (q.reshape(74, 4, 32), k.reshape(106, 2, 32), v.reshape(106, 2, 32))
    runs = []
    for op_by_op in (True, False):
        with jax.disable_jit(op_by_op):
            same = reference.attention(q, k, v, kv_seqlens=lens, compute_dtype=dt, **opts)
            f32 = reference.attention(q, k, v, kv_seqlens=lens, **opts)
            var = reference.attention_varlen(*packed, cu, cu, **opts)
        leaves = jax.tree_util.tree_leaves((same, f32, var))
        runs.append([np.asarray(x, np.float32) for x in leaves])
    eps = float(jnp.finfo(dt).eps)
    for a, b in zip(*runs, strict=True):
        if softcap is None:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=4 * eps, atol=4 * eps)


def test_default_implementation_runs_natively(rng):
    q, k, v = (randn(rng, (1, 17, 2, 64), jnp.float32) for _ in range(3))
    hlo = jax.jit(jax_flash.flash_attention).lower(q, k, v).as_text()
    assert "jax_flash_flash_attention_" in hlo


@pytest.mark.skipif(not jax_flash.has_cuda_kernels(), reason="built without CUDA kernels")
def test_cuda_lowering_without_gpu(rng, monkeypatch):
    monkeypatch.setattr(_common, "_WARNED", set())  # the fallback warns once per case
    q, k, v = (randn(rng, (1, 17, 2, 64), jnp.bfloat16) for _ in range(3))
    f = functools.partial(jax_flash.flash_attention, causal=True)
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    # o, lse and the Hopper kernel's work-item counter (int32[2] of scratch the lowering drops).
    (call,) = [line for line in text.splitlines() if "@jax_flash_flash_attention_cuda" in line]
    assert ":3 = stablehlo.custom_call" in call and call.rstrip().endswith("tensor<2xi32>)")
    big = jnp.zeros((1, 4, 2, 320), jnp.bfloat16)
    forced = functools.partial(jax_flash.flash_attention, implementation="cuda")
    with pytest.raises(ValueError, match="head dims up to 256"):
        jax.jit(forced).trace(big, big, big).lower(lowering_platforms=("cuda",))
    # implementation=None falls back to the jnp reference for head dims the kernel lacks, and
    # says so.
    assert jax_flash.kernel_for(jax_flash.flash_attention, big, big, big, platform="cuda") == (
        "xla reference"
    )
    with pytest.warns(jax_flash.NativeFallbackWarning, match="flash_attention.*head dims up to"):
        text = jax.jit(jax_flash.flash_attention).trace(big, big, big).lower(
            lowering_platforms=("cuda",)
        )  # fmt: skip
    assert "jax_flash_flash_attention_cuda" not in text.as_text()


def test_cuda_implementation_on_cpu_raises(rng):
    q = jnp.zeros((1, 4, 2, 64), jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(ValueError, match="implementation='cuda'"):
            jax.jit(functools.partial(jax_flash.flash_attention, implementation="cuda"))(q, q, q)


def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        (
            (_z(2, 4, 64), _z(2, 4, 64), _z(2, 4, 64)),
            {},
            ValueError,
            r"q must have rank 4.*\(2, 4, 64\)",
        ),
        ((_z(1, 4, 2, 64), _z(1, 4, 2), _z(1, 4, 2, 64)), {}, ValueError, "k must have rank 4"),
        ((_z(1, 4, 2, 64), _z(2, 4, 2, 64), _z(2, 4, 2, 64)), {}, ValueError, "k's batch 2"),
        ((_z(1, 4, 2, 64), _z(1, 4, 2, 32), _z(1, 4, 2, 64)), {}, ValueError, "head dim 32"),
        ((_z(1, 4, 6, 64), _z(1, 4, 4, 64), _z(1, 4, 4, 64)), {}, ValueError, r"query heads \(6\)"),
        ((_z(1, 4, 2, 64), _z(1, 4, 2, 64), _z(1, 5, 2, 64)), {}, ValueError, "v must have shape"),
        ((_z(1, 4, 2, 64, dtype=jnp.int32),) * 3, {}, TypeError, "q has dtype int32"),
        (
            (_z(1, 4, 2, 64), _z(1, 4, 2, 64, dtype=jnp.float16), _z(1, 4, 2, 64)),
            {},
            TypeError,
            "k has dtype float16",
        ),
        ((_z(1, 4, 2, 64),) * 3, dict(sliding_window=(1, 2, 3)), ValueError, "sliding_window"),
        ((_z(1, 4, 2, 64),) * 3, dict(sliding_window=(-5, 0)), ValueError, "left must be >= 0"),
        ((_z(1, 4, 2, 64),) * 3, dict(causal=True, sliding_window=(4, 2)), ValueError, "right=2"),
        (
            (_z(2, 4, 2, 64),) * 3,
            dict(q_seqlens=jnp.zeros((3,), jnp.int32)),
            ValueError,
            r"q_seqlens must have shape \(2,\), got \(3,\)",
        ),
        (
            (_z(2, 4, 2, 64),) * 3,
            dict(kv_seqlens=jnp.zeros((2,))),
            TypeError,
            "kv_seqlens must be an integer",
        ),
        ((_z(1, 4, 2, 64),) * 3, dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        ((_z(1, 4, 2, 64),) * 3, dict(implementation="triton"), ValueError, "implementation"),
        (("x", _z(1, 4, 2, 64), _z(1, 4, 2, 64)), {}, TypeError, "q must be an array"),
    ],
)
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jax_flash.flash_attention(*args, **kwargs)


@pytest.mark.parametrize(
    "cu_q,cu_k,match",
    [
        (
            jnp.zeros((3,), jnp.int32),
            jnp.zeros((4,), jnp.int32),
            r"cu_seqlens_k must have shape \(3,\)",
        ),
        (jnp.zeros((3, 1), jnp.int32), jnp.zeros((3,), jnp.int32), "cu_seqlens_q must have shape"),
        (
            jnp.zeros((3,), jnp.float32),
            jnp.zeros((3,), jnp.int32),
            "cu_seqlens_q must be an integer",
        ),
    ],
)
def test_varlen_errors(cu_q, cu_k, match):
    x = _z(8, 2, 64)
    with pytest.raises((ValueError, TypeError), match=match):
        jax_flash.flash_attention_varlen(x, x, x, cu_q, cu_k)
    with pytest.raises(ValueError, match="rank 3"):
        jax_flash.flash_attention_varlen(
            _z(1, 8, 2, 64), x, x, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32)
        )
