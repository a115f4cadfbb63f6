"""The CUDA backward kernels through their FFI target, against jax.vjp of the float32 reference.

Kernel-level checks of the tile edges the public gradient tests do not aim at: lengths that are
not multiples of the tiles, Sq != Skv, windows crossing tiles, rows that see no key, rows and
sequences owned by nobody (zeros), both kernels (tensor-core: 16-bit, D == Dv 64 / 128 and, on
the 256-wide tile, multiples of 16 in (128, 256]; SIMT: the rest), and the deterministic mode's
bit-identical reruns. GPU only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CUDA_SKIP

from jax_flash import reference
from jax_flash.primitives import flash_attention_bwd as bwd
from jax_flash.primitives.flash_attention import default_bwd_launch

from _util import randn, rel_err

pytestmark = pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP))

TARGET = "jax_flash_flash_attention_bwd_cuda"


def _bwd(q, k, v, o, lse, do, dlse, starts, cfg, deterministic, launch=None):
    """The FFI call with the attributes the primitive's lowering gives it; launch: a
    FlashBwdLaunch (which backward kernel runs on Hopper), default_bwd_launch() if None."""
    qs, qe, ks, ke = (jnp.asarray(x, jnp.int32) for x in starts)
    out = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    )
    config = bwd.FlashConfig(
        **cfg, fill_uncovered=True, implementation="cuda", deterministic=deterministic,
        _bwd_launch=launch or default_bwd_launch(),
    )  # fmt: skip
    call = jax.ffi.ffi_call(TARGET, out)
    return call(q, k, v, o, lse, do, dlse, qs, qe, ks, ke, **bwd._ffi_attrs(config))


def _tolerance(dtype):
    # Four rounding units of the dtype (P and dS are rounded to it before the mma's), and a
    # float32 floor for the float32 SIMT path's long sums.
    return max(4.0 * float(jnp.finfo(dtype).eps), 1e-5)


def _check(rng, dtype, lens_q, lens_k, hq, hkv, d, dv, cfg, *, gap=0, dlse_scale=1.0, launch=None):
    """Sequences of lengths lens_q / lens_k packed with `gap` unowned rows after each (launch:
    as _bwd's). Returns the inputs of the call (q, k, v, o, lse, do, dlse, starts, cfg) and its
    gradients."""
    starts_q, starts_k, pos_q, pos_k = [], [], 0, 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        starts_q.append(pos_q)
        starts_k.append(pos_k)
        pos_q += lq + gap
        pos_k += lk + gap
    tq, tk = max(pos_q, 1), max(pos_k, 1)
    qs = np.array(starts_q, np.int32)
    ks = np.array(starts_k, np.int32)
    starts = (qs, qs + np.array(lens_q, np.int32), ks, ks + np.array(lens_k, np.int32))
    cfg = dict(cfg, max_seqlen_q=tq)

    q = randn(rng, (tq, hq, d), dtype)
    k = randn(rng, (tk, hkv, d), dtype)
    v = randn(rng, (tk, hkv, dv), dtype)
    do = randn(rng, (tq, hq, dv), dtype)
    dlse = randn(rng, (hq, tq), jnp.float32, dlse_scale)

    def ref(q, k, v):
        return reference.attention_packed(q, k, v, *(jnp.asarray(x) for x in starts), **cfg)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (o, lse), vjp = jax.vjp(ref, *f32)
    want = vjp((do.astype(jnp.float32), dlse))
    # Rows that see no key have lse = -inf and zero gradients; the reference's vjp agrees
    # except where it makes NaN of them.
    want = [jnp.nan_to_num(w) for w in want]

    got = _bwd(q, k, v, o.astype(dtype), lse, do, dlse, starts, cfg, False, launch)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        err = rel_err(g, w)
        assert err <= _tolerance(dtype), (name, err)
    # Rows no sequence owns are zeros.
    owned_q = np.zeros(tq, bool)
    owned_k = np.zeros(tk, bool)
    for a, b in zip(starts[0], starts[1], strict=True):
        owned_q[a:b] = True
    for a, b in zip(starts[2], starts[3], strict=True):
        owned_k[a:b] = True
    assert not np.any(np.asarray(got[0])[~owned_q])
    assert not np.any(np.asarray(got[1])[~owned_k])
    assert not np.any(np.asarray(got[2])[~owned_k])
    return q, k, v, o.astype(dtype), lse, do, dlse, starts, cfg, got


CASES = [
    # name, window_left, window_right, softcap
    ("full", -1, -1, 0.0),
    ("causal", -1, 0, 0.0),
    ("window", 37, 5, 0.0),
    ("softcap_causal", -1, 0, 7.5),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 160, 192, 256])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tensor_core(rng, dtype, d, case):
    _, left, right, cap = case
    cfg = dict(softmax_scale=0.7 / np.sqrt(d), softcap=cap, window_left=left, window_right=right)
    # Sq != Skv both ways, lengths off the 64 / 128 tiles, a zero-length query row and key row.
    _check(rng, jnp.dtype(dtype), [97, 200, 0, 5], [203, 77, 9, 0], 6, 2, d, d, cfg, gap=3)


@pytest.mark.parametrize(
    "dtype,d,dv",
    [("float32", 64, 64), ("float32", 96, 40), ("bfloat16", 200, 200), ("float16", 80, 80)],
)
@pytest.mark.parametrize("case", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_simt(rng, dtype, d, dv, case):
    _, left, right, cap = case
    cfg = dict(softmax_scale=1.0 / np.sqrt(d), softcap=cap, window_left=left, window_right=right)
    _check(rng, jnp.dtype(dtype), [33, 70, 0], [50, 21, 4], 4, 4, d, dv, cfg, gap=2)


@pytest.mark.parametrize("d", [64, 128, 176, 256])
def test_deterministic(rng, d):
    cfg = dict(softmax_scale=1.0 / np.sqrt(d), softcap=0.0, window_left=-1, window_right=0)
    args = _check(rng, jnp.dtype("bfloat16"), [300, 133], [420, 520], 8, 2, d, d, cfg)
    _check_deterministic(args, reruns=3)


def _check_deterministic(args, *, reruns, launch=None):
    """args: _check's result. The deterministic mode's gradients are bit-identical over
    `reruns` reruns; its dk, dv equal the fast mode's (neither uses atomics for them) and its
    dq agrees with the fast mode's within rounding."""
    *inputs, got_fast = args
    first = _bwd(*inputs, True, launch)
    for _ in range(reruns):
        again = _bwd(*inputs, True, launch)
        for a, b in zip(first, again, strict=True):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    for a, b in zip(first[1:], got_fast[1:], strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    assert rel_err(first[0], got_fast[0]) <= _tolerance(jnp.bfloat16)
