"""Property-based fuzzing of every op against jax_flash.reference (hypothesis).

Random small shapes, dtypes and options, including the data-dependent rules on bad input that
the README promises: a paged sequence with an out-of-range page id or length gives NaN for that
sequence only, append_kv skips bad slots, varlen offsets are clamped. The ops run on the default
backend with its native kernels (implementation=None).

A few examples per test by default (CI); ``JAX_FLASH_FUZZ_EXAMPLES=10000`` spreads that many over
the tests. A failure prints the falsifying example (its seed regenerates the arrays).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference

from _util import randn, rel_err, tolerance

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

FUZZ_TESTS = 9  # the tests below that draw examples; keep in step when adding one
_TOTAL = int(os.environ.get("JAX_FLASH_FUZZ_EXAMPLES", "0"))
EXAMPLES = -(-_TOTAL // FUZZ_TESTS) if _TOTAL > 0 else 6

fuzz = hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,  # the first example of a shape compiles
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    print_blob=True,
)

FLOATS = [jnp.float32, jnp.float16, jnp.bfloat16]


def jit_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) under jax.jit: one program compiles several times faster than the
    op-by-op dispatch of the same calls (each example brings new shapes). Array arguments are
    traced; the others are fixed."""
    arrays = {n: v for n, v in kwargs.items() if hasattr(v, "shape")}
    fixed = {n: v for n, v in kwargs.items() if n not in arrays}
    return jax.jit(lambda a, kw: fn(*a, **kw, **fixed))(args, arrays)


seeds = st.integers(0, 2**32 - 1)


def _window(draw, causal):
    if draw(st.booleans()):
        return None
    left = draw(st.sampled_from([None, -1, 0, 1, 3, 17]))
    right = draw(st.sampled_from([None, -1, 0] if causal else [None, -1, 0, 2, 9]))
    return (left, right)


def _options(draw):
    causal = draw(st.booleans())
    return dict(
        causal=causal,
        sliding_window=_window(draw, causal),
        logits_soft_cap=draw(st.sampled_from([None, 0.0, 2.5, 30.0])),
        softmax_scale=draw(st.sampled_from([None, 0.3, 1.1])),
    )


def _check_attention(o, lse, ref_o, ref_lse, same_dtype_o, dtype, rows_ok=None):
    """o against the float32 reference at 2x the same-dtype jnp error; lse at dtype's eps."""
    o, ref_o = np.asarray(o, np.float64), np.asarray(ref_o, np.float64)
    lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
    if rows_ok is not None:
        assert np.all(np.isnan(o[~rows_ok])) and np.all(np.isnan(lse[~rows_ok])), (
            "a sequence with bad data must give NaN"
        )
        o, ref_o, lse, ref_lse = o[rows_ok], ref_o[rows_ok], lse[rows_ok], ref_lse[rows_ok]
        same_dtype_o = np.asarray(same_dtype_o, np.float64)[rows_ok]
    tol = tolerance(dtype, rel_err(same_dtype_o, ref_o))
    err = rel_err(o, ref_o)
    assert err <= tol, f"relative error {err:.3g} > tolerance {tol:.3g}"
    empty = np.isneginf(ref_lse)
    assert not np.any(np.isnan(lse)), "lse holds NaN"
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="lse -inf pattern")
    atol = tolerance(dtype, 0.0)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=atol, atol=atol)


# ---------------------------------------------------------------------------------------------
# Prefill attention


@st.composite
def dense_cases(draw):
    B, Sq, Skv = draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    Hkv, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 5]))
    D = draw(st.sampled_from([8, 16, 40, 64]))
    Dv = draw(st.sampled_from([D, 16, 24]))
    lens = {}
    for name, S in (("q_seqlens", Sq), ("kv_seqlens", Skv)):
        if draw(st.booleans()):
            lens[name] = draw(st.lists(st.integers(-2, S + 3), min_size=B, max_size=B))
    return dict(
        shape=(B, Sq, Skv, Hkv * group, Hkv, D, Dv),
        dtype=draw(st.sampled_from(FLOATS)),
        opts=_options(draw) | lens,
        seed=draw(seeds),
    )


@fuzz
@hypothesis.given(dense_cases())
def test_flash_attention(case):
    B, Sq, Skv, Hq, Hkv, D, Dv = case["shape"]
    dtype, rng = case["dtype"], np.random.default_rng(case["seed"])
    opts = {n: jnp.asarray(v, jnp.int32) if "seqlens" in n else v for n, v in case["opts"].items()}
    q, k = randn(rng, (B, Sq, Hq, D), dtype), randn(rng, (B, Skv, Hkv, D), dtype)
    v = randn(rng, (B, Skv, Hkv, Dv), dtype)
    o, lse = jit_call(jax_flash.flash_attention, q, k, v, return_lse=True, **opts)
    assert o.shape == (B, Sq, Hq, Dv) and o.dtype == dtype and lse.shape == (B, Hq, Sq)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_o, ref_lse = jit_call(reference.attention, *f32, return_lse=True, **opts)
    same = jit_call(reference.attention, q, k, v, compute_dtype=dtype, **opts)
    _check_attention(o, lse, ref_o, ref_lse, same, dtype)


@st.composite
def varlen_cases(draw):
    lens_q = draw(st.lists(st.integers(0, 25), min_size=1, max_size=4))
    B = len(lens_q)
    if draw(st.booleans()):
        lens_k = draw(st.lists(st.integers(0, 25), min_size=B, max_size=B))
    else:
        lens_k = list(lens_q)
    Hkv, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 3, 4]))
    D = draw(st.sampled_from([8, 32, 64]))
    return dict(
        lens=(lens_q, lens_k),
        # Offsets past the packed rows (clamped), and rows no sequence owns (zeros).
        extra_rows=(draw(st.integers(0, 5)), draw(st.integers(0, 5))),
        overshoot=draw(st.sampled_from([0, 0, 7, 1000])),
        heads=(Hkv * group, Hkv, D),
        dtype=draw(st.sampled_from(FLOATS)),
        opts=_options(draw),
        seed=draw(seeds),
    )


@fuzz
@hypothesis.given(varlen_cases())
def test_flash_attention_varlen(case):
    (lens_q, lens_k), (pad_q, pad_k) = case["lens"], case["extra_rows"]
    Hq, Hkv, D = case["heads"]
    dtype, rng = case["dtype"], np.random.default_rng(case["seed"])
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    Tq, Tk = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    cu_q[-1] += case["overshoot"]  # the last sequence's range runs past the rows: clamped
    q, k, v = randn(rng, (Tq, Hq, D), dtype), *(randn(rng, (Tk, Hkv, D), dtype) for _ in "kv")
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    o, lse = jit_call(
        jax_flash.flash_attention_varlen, q, k, v, cu_q, cu_k, return_lse=True, **case["opts"]
    )
    assert o.shape == (Tq, Hq, D) and lse.shape == (Hq, Tq)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_o, ref_lse = jit_call(
        reference.attention_varlen, *f32, cu_q, cu_k, return_lse=True, **case["opts"]
    )
    # The error of a same-dtype jnp attention: each (clamped) sequence through the dense one.
    same, owned = np.zeros((Tq, Hq, D), np.float32), np.zeros(Tq, bool)
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    for b in range(len(lens_q)):
        qs, ks = min(cq[b], Tq), min(ck[b], Tk)
        qe, ke = min(max(cq[b + 1], qs), Tq), min(max(ck[b + 1], ks), Tk)
        owned[qs:qe] = True
        if qe > qs and ke > ks:
            seq = (q[None, qs:qe], k[None, ks:ke], v[None, ks:ke])
            same[qs:qe] = jit_call(reference.attention, *seq, compute_dtype=dtype, **case["opts"])[
                0
            ]
    _check_attention(o, lse, ref_o, ref_lse, same, dtype)
    assert np.all(np.asarray(o)[~owned] == 0), "rows no sequence owns must be zero"


# ---------------------------------------------------------------------------------------------
# Paged attention


@st.composite
def paged_cases(draw):
    B, page_size = draw(st.integers(1, 4)), draw(st.sampled_from([1, 3, 8, 16]))
    Hkv, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4, 5]))
    Sq = draw(st.sampled_from([None, 1, 2, 3]))  # None: q [B, Hq, D]
    max_pages = draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, max_pages * page_size), min_size=B, max_size=B))
    if Sq is not None:
        lens = [max(n, Sq) for n in lens]  # the Sq queries are in the cache
        max_pages = max(max_pages, -(-max(lens) // page_size))
    bad = draw(st.lists(st.sampled_from(["", "", "", "len", "neg", "page"]), min_size=B))
    causal = draw(st.booleans())
    return dict(
        # head dims of the tensor-core kernel's three tiles, padded ones, and D != Dv
        shape=(B, Sq, Hkv * group, Hkv, draw(st.sampled_from([16, 48, 64, 80, 128]))),
        head_dim_v=draw(st.sampled_from([None, None, 32, 96])),  # None: D
        page_size=page_size,
        max_pages=max_pages,
        lens=lens,
        bad=bad[:B],
        dtype=draw(st.sampled_from(FLOATS)),
        cache=draw(st.sampled_from(["same", "same", "int8", "float8_e4m3fn"])),
        per_token=draw(st.booleans()),
        num_splits=draw(st.sampled_from([None, None, 1, 2, 3])),
        opts=dict(
            causal=causal,
            sliding_window=_window(draw, causal),
            logits_soft_cap=draw(st.sampled_from([None, 3.0])),
        ),
        seed=draw(seeds),
    )


@fuzz
@hypothesis.given(paged_cases())
def test_paged_attention(case):
    B, Sq, Hq, Hkv, D = case["shape"]
    Dv = case["head_dim_v"] or D
    page, max_pages, dtype = case["page_size"], case["max_pages"], case["dtype"]
    rng = np.random.default_rng(case["seed"])
    num_pages = B * max_pages + 2
    bt = rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages).astype(np.int32)
    lens = np.asarray(case["lens"], np.int32)
    for b, kind in enumerate(case["bad"]):  # bad device data: NaN for that sequence only
        if kind == "len":
            lens[b] = max_pages * page + 1 + rng.integers(0, 50)
        elif kind == "neg":
            lens[b] = -1 - rng.integers(0, 5)
        elif kind == "page" and lens[b] > 0:
            bt[b, rng.integers(0, -(-lens[b] // page))] = rng.choice([-1, num_pages, 2**30])
    kf = randn(rng, (num_pages, page, Hkv, D), dtype)
    vf = randn(rng, (num_pages, page, Hkv, Dv), dtype)
    scales = {}
    kp, vp = kf, vf
    if case["cache"] != "same":
        cdt = jnp.dtype(case["cache"])
        if case["per_token"]:
            ks, vs = (reference.per_token_scale(x, cdt) for x in (kf, vf))
            kp, vp = (reference.quantize(x, s[..., None], cdt) for x, s in ((kf, ks), (vf, vs)))
        else:
            amax = [jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1, 3)) for x in (kf, vf)]
            ks, vs = (a / reference.QMAX[case["cache"]] for a in amax)
            kp, vp = (reference.quantize(x, s[:, None], cdt) for x, s in ((kf, ks), (vf, vs)))
        scales = dict(k_scale=ks, v_scale=vs)
    q = randn(rng, (B, Hq, D) if Sq is None else (B, Sq, Hq, D), dtype)
    bt, lens = jnp.asarray(bt), jnp.asarray(lens)
    o, lse = jit_call(
        jax_flash.paged_attention, q, kp, vp, bt, lens, num_splits=case["num_splits"],
        return_lse=True, **scales, **case["opts"],
    )  # fmt: skip
    assert o.shape == q.shape[:-1] + (Dv,) and o.dtype == dtype
    ref_o, ref_lse = jit_call(
        reference.paged_attention,
        q.astype(jnp.float32),
        kp,
        vp,
        bt,
        lens,
        return_lse=True,
        **scales,
        **case["opts"],
    )
    # The error a same-dtype jnp attention makes on the same (dequantised) cache.
    q4 = q if Sq is not None else q[:, None]
    kd, vd = (
        reference.gather_pages(x, bt, scales.get(n)).astype(dtype)
        for x, n in ((kp, "k_scale"), (vp, "v_scale"))
    )
    lens_c = jnp.clip(lens, 0, kd.shape[1])
    same = jit_call(
        reference.attention, q4, kd, vd, kv_seqlens=lens_c, compute_dtype=dtype, **case["opts"]
    )
    same = same if Sq is not None else same[:, 0]
    ok = np.asarray(reference.paged_sequence_valid(bt, lens, num_pages, page))
    _check_attention(o, lse, ref_o, ref_lse, same, dtype, rows_ok=ok)


# ---------------------------------------------------------------------------------------------
# The paged cache: append_kv (plain and with the fused RoPE), copy_pages, slot_mapping


@st.composite
def append_cases(draw):
    num_pages, page = draw(st.integers(1, 6)), draw(st.sampled_from([1, 4, 5, 16]))
    n_slots = num_pages * page
    T = draw(st.integers(0, 12))
    # Distinct valid slots (a repeated slot has no defined winner), with bad ones mixed in.
    n_valid = min(T, n_slots)
    valid = draw(st.lists(st.integers(0, n_slots - 1), min_size=n_valid, max_size=n_valid,
                          unique=True))  # fmt: skip
    slots = [
        s if draw(st.integers(0, 5)) else draw(st.sampled_from([-1, -7, n_slots, 2**31 - 1]))
        for s in valid + [-1] * (T - n_valid)
    ]
    rope = None
    if draw(st.booleans()):
        rope = dict(
            style=draw(st.sampled_from(["neox", "gptj"])),
            theta=draw(st.sampled_from([10000.0, 500000.0])),
        )
    return dict(
        cache_shape=(num_pages, page, draw(st.integers(1, 3)), draw(st.sampled_from([8, 64]))),
        slots=slots,
        dtype=draw(st.sampled_from(FLOATS)),
        cache=draw(st.sampled_from(["same", "int8", "float8_e4m3fn"])),
        per_token=draw(st.booleans()),
        rope=rope,
        q_heads=draw(st.sampled_from([0, 1, 2])),
        seed=draw(seeds),
    )


def _bits(x):
    return np.asarray(x).view(np.uint8)


@fuzz
@hypothesis.given(append_cases())
def test_append_kv(case):
    """Bit-equal to the reference (scatter, quantisation); a round trip reads the rows back."""
    P, page, Hkv, D = case["cache_shape"]
    dtype, rng = case["dtype"], np.random.default_rng(case["seed"])
    quantized = case["cache"] != "same"
    cdt = jnp.dtype(dtype if not quantized else case["cache"])
    kp = randn(rng, (P, page, Hkv, D), jnp.float32).astype(cdt)
    vp = randn(rng, (P, page, Hkv, D), jnp.float32).astype(cdt)
    scales = {}
    if quantized:
        shape = (P, page, Hkv) if case["per_token"] else (Hkv,)
        scales = {n: jnp.asarray(rng.uniform(0.01, 0.05, shape), jnp.float32) for n in "kv"}
        scales = dict(k_scale=scales["k"], v_scale=scales["v"])
    slots = jnp.asarray(case["slots"], jnp.int32)
    T = slots.shape[0]
    kn, vn = randn(rng, (T, Hkv, D), dtype), randn(rng, (T, Hkv, D), dtype)
    if case["rope"] is None:
        out = jit_call(jax_flash.append_kv, kp, vp, kn, vn, slots, **scales)
        ref = jit_call(reference.append_kv, kp, vp, kn, vn, slots, **scales)
        k_written = kn
    else:
        pos = jnp.asarray(rng.integers(-3, 5000, T), jnp.int32)
        q = randn(rng, (T, Hkv * case["q_heads"], D), dtype) if case["q_heads"] else None
        out = jit_call(
            jax_flash.append_kv,
            kp,
            vp,
            kn,
            vn,
            slots,
            positions=pos,
            rope=case["rope"],
            q=q,
            **scales,
        )
        style = case["rope"]["style"]
        inv_freq = reference.rope_inv_freq(D, case["rope"]["theta"])
        # Eager: under jit XLA may fuse the rotation into multiply-adds, other bits than the
        # kernels' (and apply_rope's) separate multiplies and adds.
        q_rot, *ref = reference.append_kv_rope(
            kp, vp, kn, vn, slots, pos, inv_freq, style=style, q=q, **scales
        )
        if q is not None:
            np.testing.assert_array_equal(_bits(out[0]), _bits(q_rot), err_msg="rotated q")
            out = out[1:]
        k_written = reference.apply_rope(kn, pos, inv_freq, style=style)
    for got, want in zip(out, ref, strict=False):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # Round trip: every row with a good slot reads back (dequantised: within a step).
    good = np.flatnonzero((np.asarray(slots) >= 0) & (np.asarray(slots) < P * page))
    s = np.asarray(slots)[good]
    back_k = np.asarray(out[0].astype(jnp.float32)).reshape(P * page, Hkv, D)[s]
    want_k = np.asarray(k_written.astype(jnp.float32))[good]
    if not quantized:
        np.testing.assert_array_equal(back_k, want_k)
    else:
        scale = np.asarray(out[2]).reshape(P * page, Hkv)[s] if case["per_token"] else None
        scale = np.asarray(scales["k_scale"])[None] if scale is None else scale
        err = np.abs(back_k * scale[..., None] - want_k)
        step = scale[..., None] * (1.0 if case["cache"] == "int8" else 32.0)
        clipped = np.abs(want_k) > scale[..., None] * reference.QMAX[case["cache"]]
        assert np.all((err <= step) | clipped), "a quantised row does not read back"


@fuzz
@hypothesis.given(
    st.integers(1, 8),
    st.sampled_from([1, 2, 8]),
    st.lists(st.tuples(st.integers(-2, 10), st.integers(-2, 10)), max_size=6),
    st.sampled_from(["same", "int8"]),
    seeds,
)
def test_copy_pages(P, page, pairs, cache, seed):
    rng = np.random.default_rng(seed)
    # Destinations distinct and not sources (the documented contract); bad ids are skipped.
    seen, src, dst = set(), [], []
    for s, d in pairs:
        if d not in seen and d != s and d not in src and s not in dst:
            seen.add(d)
            src.append(s)
            dst.append(d)
    cdt = jnp.float32 if cache == "same" else jnp.int8
    kp, vp = (randn(rng, (P, page, 2, 8), jnp.float32, 50.0).astype(cdt) for _ in "kv")
    scales = {}
    if cache == "int8":
        scales = {
            n: jnp.asarray(rng.random((P, page, 2)), jnp.float32) for n in ("k_scale", "v_scale")
        }
    src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
    out = jax_flash.copy_pages(kp, vp, src, dst, **scales)
    ref = reference.copy_pages(kp, vp, src, dst, **scales)
    for got, want in zip(out, ref, strict=False):
        np.testing.assert_array_equal(_bits(got), _bits(want))


@fuzz
@hypothesis.given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 9),
    st.sampled_from([None, 1, 6]),
    st.booleans(),
    seeds,
)
def test_slot_mapping(B, max_pages, page_size, S, masked, seed):
    rng = np.random.default_rng(seed)
    bt = rng.integers(0, 100, (B, max_pages)).astype(np.int32)
    shape = (B,) if S is None else (B, S)
    pos = rng.integers(-2, max_pages * page_size + 3, shape).astype(np.int32)
    valid = rng.random(shape) < 0.7 if masked else np.ones(shape, bool)
    got = jax_flash.slot_mapping(
        jnp.asarray(bt), jnp.asarray(pos), page_size, jnp.asarray(valid) if masked else None
    )
    p = pos if S is not None else pos[:, None]
    rows = np.arange(B)[:, None]
    inside = (p >= 0) & (p < max_pages * page_size)
    page = bt[rows, np.clip(p // page_size, 0, max_pages - 1)]
    want = np.where(inside & valid.reshape(p.shape), page * page_size + p % page_size, -1)
    np.testing.assert_array_equal(np.asarray(got), want.reshape(shape))


# ---------------------------------------------------------------------------------------------
# RoPE and sampling


@fuzz
@hypothesis.given(
    st.lists(st.integers(1, 5), min_size=1, max_size=2),
    st.integers(1, 3),
    st.sampled_from([2, 6, 16, 64]),
    st.sampled_from(FLOATS),
    st.sampled_from(["neox", "gptj"]),
    st.booleans(),
    st.sampled_from([None, {"type": "linear", "factor": 4.0}]),
    seeds,
)
def test_apply_rope(lead, H, D, dtype, style, partial, scaling, seed):
    rng = np.random.default_rng(seed)
    rd = D if not partial or D == 2 else 2 * int(rng.integers(1, D // 2))
    x = randn(rng, (*lead, H, D), dtype)
    pos = jnp.asarray(rng.integers(-100, 70000, lead), jnp.int32)
    out = jit_call(jax_flash.apply_rope, x, pos, style=style, rotary_dim=rd, scaling=scaling)
    inv_freq = reference.rope_inv_freq(rd, 10000.0, scaling)
    ref = jit_call(
        reference.apply_rope, x.astype(jnp.float32), pos, inv_freq, style=style, rotary_dim=rd
    )
    assert out.shape == x.shape and out.dtype == dtype
    tol = tolerance(dtype, rel_err(ref.astype(dtype), ref))
    assert rel_err(out, ref) <= tol
    np.testing.assert_array_equal(_bits(out[..., rd:]), _bits(x[..., rd:]))


@st.composite
def sampling_cases(draw):
    B, V = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 7, 64, 300]))
    per_row = draw(st.booleans())

    def param(values):
        if per_row:
            return np.asarray(draw(st.lists(st.sampled_from(values), min_size=B, max_size=B)))
        return draw(st.sampled_from(values))

    return dict(
        shape=(B, V),
        dtype=draw(st.sampled_from(FLOATS)),
        params=dict(
            temperature=param([0.0, 0.5, 1.0, 1.7]),
            top_k=param([0, 1, 3, 50]),
            top_p=param([1.0, 0.9, 0.5, 1e-6]),
            min_p=param([0.0, 0.05, 0.3]),
        ),
        specials=draw(st.sampled_from(["", "ties", "-inf", "nan-row"])),
        seed=draw(seeds),
    )


def _sampling_logits(case):
    B, V = case["shape"]
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal((B, V)).astype(np.float32) * 3
    if case["specials"] == "ties":
        x = np.round(x)
    elif case["specials"] == "-inf":
        x[rng.random((B, V)) < 0.3] = -np.inf
    elif case["specials"] == "nan-row":
        x[0] = np.nan if V > 1 else -np.inf
    return jnp.asarray(x).astype(case["dtype"])


def _top_p_ambiguous(logits, params):
    """[B] bool: a row's top-p cut lies within float32 rounding of a prefix's mass (the
    kernels' exact fixed-point sums and the reference's float32 sums may cut differently)."""
    x = np.asarray(logits.astype(jnp.float32), np.float64)
    B, V = x.shape
    out = np.zeros(B, bool)
    p = {n: np.broadcast_to(np.asarray(v, np.float64), (B,)) for n, v in params.items()}
    for b in range(B):
        xb = np.sort(np.where(np.isnan(x[b]), -np.inf, x[b]))[::-1]
        if not (p["temperature"][b] > 0 and p["top_p"][b] < 1 and xb[0] > -np.inf):
            continue
        k = int(p["top_k"][b]) if 0 < p["top_k"][b] < V else V
        mass = np.exp((xb[:k] - xb[0]) / p["temperature"][b])
        cum = np.cumsum(mass) / mass.sum()
        out[b] = np.any(np.abs(cum - p["top_p"][b]) < 1e-5)
    return out


@fuzz
@hypothesis.given(sampling_cases())
def test_top_k_top_p_filter(case):
    logits, params = _sampling_logits(case), case["params"]
    out = jit_call(jax_flash.top_k_top_p_filter, logits, **params)
    rows = {n: jnp.broadcast_to(jnp.asarray(v), (case["shape"][0],)) for n, v in params.items()}
    ref = jit_call(reference.top_k_top_p_filter, logits, *(rows[n] for n in ("temperature", "top_k",
                                                                   "top_p", "min_p")))  # fmt: skip
    kept, ref_kept = np.asarray(out) > -np.inf, np.asarray(ref) > -np.inf
    same = np.all(kept == ref_kept, axis=1) | _top_p_ambiguous(logits, params)
    assert np.all(same), f"kept sets differ in rows {np.flatnonzero(~same)}"
    exact = np.all(kept == ref_kept, axis=1)
    np.testing.assert_array_equal(_bits(out[exact]), _bits(ref[exact]))
    # Every kept set is a prefix of the order (logit descending, index ascending).
    x = np.asarray(logits.astype(jnp.float32))
    for b in range(x.shape[0]):
        if kept[b].any():
            assert np.nan_to_num(x[b][kept[b]], nan=-np.inf).min() >= np.nan_to_num(
                x[b][~kept[b]], nan=-np.inf
            ).max(initial=-np.inf)


@fuzz
@hypothesis.given(sampling_cases(), seeds)
def test_sample(case, key_seed):
    logits, params = _sampling_logits(case), case["params"]
    key = jax.random.key(key_seed)
    tokens = np.asarray(jax_flash.sample(logits, key, **params))
    again = np.asarray(jax.jit(functools.partial(jax_flash.sample, **params))(logits, key))
    np.testing.assert_array_equal(tokens, again, err_msg="eager and jit draw differently")
    B, V = case["shape"]
    kept = np.asarray(jax_flash.top_k_top_p_filter(logits, **params)) > -np.inf
    none = ~kept.any(axis=1)
    np.testing.assert_array_equal(tokens[none], -1, err_msg="rows without a finite logit")
    assert np.all((tokens[~none] >= 0) & (tokens[~none] < V))
    assert np.all(kept[np.flatnonzero(~none), tokens[~none]]), "a token outside the kept set"
    greedy = np.broadcast_to(np.asarray(params["temperature"]), (B,)) == 0
    x = np.nan_to_num(np.asarray(logits.astype(jnp.float32)), nan=-np.inf)
    argmax = np.argmax(x, axis=1)
    np.testing.assert_array_equal(tokens[greedy & ~none], argmax[greedy & ~none])
