"""paged_attention, append_kv, copy_pages, reorder_beams against jax_flash.reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_flash
from jax_flash import reference
from jax_flash.primitives.paged_attention import PagedLaunch, policy

from _util import DTYPES, randn, rel_err, tolerance


def _cpu(*xs):
    cpu = jax.devices("cpu")[0]
    return [None if x is None else jax.device_put(x, cpu) for x in xs]


def make_cache(rng, kv_lens, page_size, Hkv, D, dtype, spare=3):
    """Random pages, each sequence's pages a random permutation of the pool."""
    kv_lens = np.asarray(kv_lens, np.int32)
    pages_needed = [max(1, -(-int(n) // page_size)) for n in kv_lens]
    max_pages = max(pages_needed) + 1
    num_pages = sum(pages_needed) + spare
    perm = rng.permutation(num_pages).astype(np.int32)
    bt = np.full((len(kv_lens), max_pages), -1, np.int32)  # unused entries: garbage ids
    at = 0
    for b, n in enumerate(pages_needed):
        bt[b, :n] = perm[at : at + n]
        at += n
    k_pages = randn(rng, (num_pages, page_size, Hkv, D), dtype)
    v_pages = randn(rng, (num_pages, page_size, Hkv, D), dtype)
    return k_pages, v_pages, jnp.asarray(bt), jnp.asarray(kv_lens)


def _launch(platform, q, k_pages, k_scale=None, v_pages=None):
    """The keyword that asks paged_attention for the platform's CUDA kernel ({} for the default),
    after checking with jax_flash.kernel_for that the call runs that kernel. A kernel asked for
    a call it does not take must raise: checked here, then the test is skipped."""
    if platform.name == "cuda":
        v_pages = k_pages if v_pages is None else v_pages
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": k_scale}
        bt = jnp.zeros((q.shape[0], 1), jnp.int32)
        kl = jnp.zeros((q.shape[0],), jnp.int32)
        launch = {} if platform.kernel is None else {"_launch": PagedLaunch(platform.kernel)}
        call = functools.partial(jax_flash.paged_attention, **scales, **launch)
        if platform.kernel == "tensor_core" and not _mma_takes(q, k_pages, v_pages, k_scale):
            with pytest.raises(ValueError, match="tensor-core kernel was asked for"):
                call(q, k_pages, v_pages, bt, kl)
            pytest.skip(
                f"the tensor-core kernel does not take this call ({q.dtype}, {k_pages.dtype} "
                f"cache, D {k_pages.shape[3]}, Dv {v_pages.shape[3]})"
            )
        ran = jax_flash.kernel_for(call, q, k_pages, v_pages, bt, kl, platform="cuda")
        if platform.kernel == "cuda_core" and ran == "xla reference":
            with pytest.raises(ValueError, match="no CUDA kernel takes"):
                call(q, k_pages, v_pages, bt, kl, implementation="cuda")
            pytest.skip(f"the CUDA-core kernel does not take D {k_pages.shape[3]}, "
                        f"Dv {v_pages.shape[3]}")  # fmt: skip
        if platform.kernel is not None:
            assert ran == f"cuda:{platform.kernel}", ran
    return {} if platform.kernel is None else {"_launch": PagedLaunch(kernel=platform.kernel)}


def _mma_takes(q, k_pages, v_pages, k_scale):
    mode = 0 if k_scale is None else 1 if k_scale.ndim == 1 else 2
    P, page, Hkv, D = k_pages.shape
    return policy.paged_mma_supported(
        q.dtype.name, k_pages.dtype.name, mode, D, v_pages.shape[3], P, page, Hkv
    )


def _check(platform, rng, q, k_pages, v_pages, bt, lens, *, k_scale=None, v_scale=None, **opts):
    fn = functools.partial(
        jax_flash.paged_attention,
        return_lse=True,
        implementation=platform.name,
        **_launch(platform, q, k_pages, k_scale, v_pages),
        **opts,
    )
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    put = {n: platform.put(x) for n, x in scales.items()}
    o, lse = jax.jit(functools.partial(fn, **put))(*platform.put(q, k_pages, v_pages, bt, lens))
    q, k_pages, v_pages, bt, lens = _cpu(q, k_pages, v_pages, bt, lens)
    scales = dict(zip(scales, _cpu(*scales.values()), strict=True))
    ropts = {n: v for n, v in opts.items() if n != "num_splits"}
    ref_o, ref_lse = reference.paged_attention(
        q.astype(jnp.float32), k_pages, v_pages, bt, lens, return_lse=True, **scales, **ropts
    )
    # The error a same-dtype jnp attention makes on the same (dequantised) cache.
    q4 = q if q.ndim == 4 else q[:, None]
    kd = reference.gather_pages(k_pages, bt, scales.get("k_scale")).astype(q.dtype)
    vd = reference.gather_pages(v_pages, bt, scales.get("v_scale")).astype(q.dtype)
    lens_c = jnp.clip(lens, 0, kd.shape[1])
    same = reference.attention(q4, kd, vd, kv_seqlens=lens_c, compute_dtype=q.dtype, **ropts)
    same = same if q.ndim == 4 else same[:, 0]
    ok = np.asarray(reference.paged_sequence_valid(bt, lens, k_pages.shape[0], k_pages.shape[1]))
    o, lse, ref_o, ref_lse = (np.asarray(x, np.float32) for x in (o, lse, ref_o, ref_lse))
    same = np.asarray(same, np.float32)
    assert np.all(np.isnan(o[~ok])) and np.all(np.isnan(lse[~ok])), "bad sequences must be NaN"
    tol = tolerance(q.dtype, rel_err(same[ok], ref_o[ok]))
    err = rel_err(o[ok], ref_o[ok])
    assert err <= tol, f"relative error {err:.3g} > tolerance {tol:.3g}"
    empty = np.isneginf(ref_lse[ok])
    np.testing.assert_array_equal(np.isneginf(lse[ok]), empty)
    atol = tolerance(q.dtype, 0.0)
    np.testing.assert_allclose(lse[ok][~empty], ref_lse[ok][~empty], rtol=atol, atol=atol)
    return o, lse


@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 64, 128, 256])
def test_page_sizes(kernel_platform, rng, page_size):
    lens = [0, 1, page_size - 1 or 1, page_size + 1, 700]
    kp, vp, bt, kl = make_cache(rng, lens, page_size, 2, 64, jnp.bfloat16)
    q = randn(rng, (len(lens), 8, 64), jnp.bfloat16)
    o, _ = _check(kernel_platform, rng, q, kp, vp, bt, kl)
    assert np.all(o[0] == 0), "kv_len 0 gives zeros"


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gqa_queries_splits(kernel_platform, rng, group, sq, num_splits, dtype):
    Hkv, D = 2, 128
    lens = [5, 16, 97, 333]
    kp, vp, bt, kl = make_cache(rng, lens, 16, Hkv, D, DTYPES[dtype])
    shape = (len(lens), Hkv * group, D) if sq == 1 else (len(lens), sq, Hkv * group, D)
    q = randn(rng, shape, DTYPES[dtype])
    _check(kernel_platform, rng, q, kp, vp, bt, kl, num_splits=num_splits)


@pytest.mark.parametrize(
    "opts",
    [
        {"logits_soft_cap": 4.0, "softmax_scale": 0.25},
        {"sliding_window": (40, None)},
        {"sliding_window": (3, 0), "causal": True},
        {"causal": False},
    ],
    ids=str,
)
def test_options(kernel_platform, rng, opts):
    kp, vp, bt, kl = make_cache(rng, [2, 50, 300], 16, 4, 64, jnp.float16)
    q = randn(rng, (3, 4, 8, 64), jnp.float16)
    _check(kernel_platform, rng, q, kp, vp, bt, kl, num_splits=2, **opts)


def test_fixed_split_is_deterministic(kernel_platform, rng):
    kp, vp, bt, kl = make_cache(rng, [4000, 3000], 16, 2, 128, jnp.bfloat16)
    q = randn(rng, (2, 8, 128), jnp.bfloat16)
    fn = jax.jit(
        functools.partial(
            jax_flash.paged_attention,
            num_splits=7,
            implementation=kernel_platform.name,
            **_launch(kernel_platform, q, kp),
        )
    )
    args = kernel_platform.put(q, kp, vp, bt, kl)
    a, b = np.asarray(fn(*args)), np.asarray(fn(*args))
    np.testing.assert_array_equal(a, b)
    _check(kernel_platform, rng, q, kp, vp, bt, kl, num_splits=7)
    _check(kernel_platform, rng, q, kp, vp, bt, kl)  # the heuristic's choice


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_cache(kernel_platform, rng, cache_dtype, per_token):
    cdt = jnp.dtype(cache_dtype)
    lens = [1, 31, 200]
    kf, vf, bt, kl = make_cache(rng, lens, 16, 2, 64, jnp.bfloat16)
    P, page = kf.shape[:2]
    if per_token:
        ks, vs = (reference.per_token_scale(x, cdt) for x in (kf, vf))
        kq = reference.quantize(kf, ks[..., None], cdt)
        vq = reference.quantize(vf, vs[..., None], cdt)
    else:
        ks = jnp.max(jnp.abs(kf.astype(jnp.float32)), axis=(0, 1, 3)) / reference.QMAX[cache_dtype]
        vs = jnp.max(jnp.abs(vf.astype(jnp.float32)), axis=(0, 1, 3)) / reference.QMAX[cache_dtype]
        kq = reference.quantize(kf, ks[:, None], cdt)
        vq = reference.quantize(vf, vs[:, None], cdt)
    q = randn(rng, (3, 8, 64), jnp.bfloat16)
    o, _ = _check(kernel_platform, rng, q, kq, vq, bt, kl, k_scale=ks, v_scale=vs, num_splits=2)
    # Against the unquantized bf16 cache: the quantisation error itself.
    exact = reference.paged_attention(q.astype(jnp.float32), kf, vf, bt, kl)
    qerr = rel_err(o, exact)
    assert qerr < (0.03 if cache_dtype == "int8" else 0.1), qerr


# Head dims of real models: 16 and 32 (small test models), 80 (Phi-2), 96 (Phi-3-mini), 112, 160,
# 256, and D != Dv (192/128 as DeepSeek's MLA prefill, 128/64; 96/80 and 64/112 pad K or V on
# the 128-wide tile): the tensor-core kernel runs them on its 64 / 128 / 256 tiles
# (policy::paged_mma_tile_dim); the CUDA-core kernel takes 64, 128, 256 with D == Dv only (the
# others skip on it, after checking that it refuses them).
HEAD_DIMS = [(16, 16), (32, 32), (80, 80), (96, 96), (112, 112), (160, 160), (256, 256),
             (192, 128), (128, 64), (48, 208), (96, 80), (64, 112)]  # fmt: skip


# The 8-bit caches on one head dim per tile width and a D != Dv (CPU time in CI).
CASES = [(d, dv, "same") for d, dv in HEAD_DIMS] + [
    (d, dv, c) for d, dv in ((32, 32), (80, 80), (192, 128)) for c in ("int8", "float8_e4m3fn")
]


# The CPU kernel has no tiles by head dim: it runs one case per tile width, a D != Dv, and each
# 8-bit cache once (the others take tens of seconds of CI's two cores each).
CPU_CASES = {(16, 16, "same"), (96, 96, "same"), (160, 160, "same"), (48, 208, "same"),
             (80, 80, "int8"), (192, 128, "float8_e4m3fn")}  # fmt: skip


@pytest.mark.parametrize("d,dv,cache", CASES)
def test_head_dims(kernel_platform, rng, d, dv, cache):
    if kernel_platform.name == "cpu" and (d, dv, cache) not in CPU_CASES:
        pytest.skip("head-dim tiling case: the CPU kernel runs the CPU_CASES")
    dtype = jnp.float16 if cache == "int8" else jnp.bfloat16
    lens = [1, 97, 300]
    kf, _, bt, kl = make_cache(rng, lens, 16, 2, d, dtype)
    vf = randn(rng, kf.shape[:3] + (dv,), dtype)
    scales = {}
    kp, vp = kf, vf
    if cache != "same":
        cdt = jnp.dtype(cache)
        if cache == "int8":  # per head
            ks, vs = (jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1, 3)) / 127.0
                      for x in (kf, vf))  # fmt: skip
            kp = reference.quantize(kf, ks[:, None], cdt)
            vp = reference.quantize(vf, vs[:, None], cdt)
        else:  # per token
            ks, vs = (reference.per_token_scale(x, cdt) for x in (kf, vf))
            kp = reference.quantize(kf, ks[..., None], cdt)
            vp = reference.quantize(vf, vs[..., None], cdt)
        scales = {"k_scale": ks, "v_scale": vs}
    for sq, splits in ((1, 3), (4, 1)):
        shape = (len(lens), 6, d) if sq == 1 else (len(lens), sq, 6, d)
        q = randn(rng, shape, dtype)
        o, _ = _check(kernel_platform, rng, q, kp, vp, bt, kl, num_splits=splits, **scales)
        assert o.shape == shape[:-1] + (dv,)


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("q_mag", [1e-6, 3e4])
@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_cache_wide_ranges(kernel_platform, rng, cache_dtype, q_mag, cap):
    """bfloat16 q far outside float16's range (the CUDA kernel runs Q K^T in float16 on a
    rescaled q) and per-token V scales spanning 10^6 (P V runs in float16 against a running
    reference scale)."""
    cdt = jnp.dtype(cache_dtype)
    lens = [3, 250, 1000]
    D, Hkv, G = 128, 2, 8
    kf, vf, bt, kl = make_cache(rng, lens, 16, Hkv, D, jnp.float32)
    P, page = kf.shape[:2]
    kf = kf * 10.0 ** rng.uniform(-0.5, 0.5, (P, page, Hkv, 1))
    vf = vf * 10.0 ** rng.uniform(-3.0, 3.0, (P, page, Hkv, 1))
    ks, vs = (reference.per_token_scale(x, cdt) for x in (kf, vf))
    kq = reference.quantize(kf, ks[..., None], cdt)
    vq = reference.quantize(vf, vs[..., None], cdt)
    q = (randn(rng, (len(lens), Hkv * G, D), jnp.float32) * q_mag).astype(jnp.bfloat16)
    assert not np.any(np.isinf(np.asarray(q, np.float32)))
    opts = {"softmax_scale": 1.0 / (q_mag * np.sqrt(D))}
    if cap is not None:
        opts["logits_soft_cap"] = cap
    _check(kernel_platform, rng, q, kq, vq, bt, kl, k_scale=ks, v_scale=vs, **opts)


def test_bad_data_gives_nan_for_that_sequence_only(kernel_platform, rng):
    kp, vp, bt, kl = make_cache(rng, [40, 40, 40, 40, 40], 16, 2, 64, jnp.float32)
    P = kp.shape[0]
    bt = bt.at[1, 1].set(P + 1000).at[2, 0].set(-5)  # invalid ids among the used pages
    bt = bt.at[0, 3].set(10**6)  # an invalid id past the used pages is never read: fine
    kl = kl.at[3].set(10**6).at[4].set(-1)  # beyond capacity, negative
    q = randn(rng, (5, 4, 64), jnp.float32)
    o, _ = _check(kernel_platform, rng, q, kp, vp, bt, kl, num_splits=2)
    assert np.all(np.isfinite(o[0]))
    assert np.all(np.isnan(o[1:]))

    def f(bt, kl):
        jax_flash.check_paged_inputs(bt, kl, P, 16)
        return kl

    err, _ = checkify.checkify(f)(*_cpu(bt, kl))
    assert "kv_lens[3] = 1000000" in err.get()
    err, _ = checkify.checkify(f)(*_cpu(bt, kl.at[3].set(1).at[4].set(1)))
    assert "block_tables[1, 1]" in err.get()
    err, _ = checkify.checkify(f)(*_cpu(bt.at[1, 1].set(0).at[2, 0].set(0), kl.at[3:].set(1)))
    assert err.get() is None


# Split counts from 2 to 32, with one chunk of query rows per kv head and with several (5 x 4
# rows). Short and zero lengths leave splits without keys; a bad page id in one sequence's later
# split and a bad length make those sequences NaN while the others stay exact.
SPLIT_CASES = [(64, "same", 1), (128, "same", 1), (256, "same", 1), (112, "same", 1),
               (128, "int8", 1), (128, "same", 5)]  # fmt: skip


@pytest.mark.parametrize("splits", [2, 5, 16, 32])
@pytest.mark.parametrize("d,cache,sq", SPLIT_CASES)
def test_many_splits(kernel_platform, rng, splits, d, cache, sq):
    if kernel_platform.name == "cpu" and splits != 2:
        # The CPU kernel picks its own split of the keys (num_splits is a CUDA launch choice):
        # every splits value runs the same computation there.
        pytest.skip("num_splits does not change the CPU kernel: it runs splits=2 only")
    lens = [0, 9, 700, 2051, 1500, 300]
    dtype = jnp.float16 if cache == "int8" else jnp.bfloat16
    kp, vp, bt, kl = make_cache(rng, lens, 16, 2, d, dtype)
    bt = bt.at[4, 80].set(kp.shape[0] + 7)  # sequence 4: a bad id among its last pages
    kl = kl.at[5].set(-3)  # sequence 5: a bad length
    scales = {}
    if cache == "int8":
        ks, vs = (jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1, 3)) / 127.0
                  for x in (kp, vp))  # fmt: skip
        kp = reference.quantize(kp, ks[:, None], jnp.int8)
        vp = reference.quantize(vp, vs[:, None], jnp.int8)
        scales = {"k_scale": ks, "v_scale": vs}
    shape = (len(lens), 8, d) if sq == 1 else (len(lens), sq, 8, d)
    q = randn(rng, shape, dtype)
    o, _ = _check(kernel_platform, rng, q, kp, vp, bt, kl, num_splits=splits, **scales)
    assert np.all(o[0] == 0), "kv_len 0 gives zeros"
    assert np.all(np.isnan(o[4:])) and np.all(np.isfinite(o[:4]))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_empty_cache_gives_nan(kernel_platform, rng, cache_dtype):
    """A cache of no pages: every id is invalid, so sequences with keys get NaN, and no kernel
    reads the (empty) cache."""
    kp = jnp.zeros((0, 16, 2, 64), cache_dtype)
    scales = {}
    if cache_dtype != "bfloat16":
        scales = {"k_scale": jnp.zeros((0, 16, 2), jnp.float32)}
        scales["v_scale"] = scales["k_scale"]
    bt = jnp.zeros((3, 4), jnp.int32)
    kl = jnp.array([5, 64, 17], jnp.int32)
    q = randn(rng, (3, 8, 64), jnp.bfloat16)  # (no page: the CUDA-core kernel takes it)
    fn = functools.partial(
        jax_flash.paged_attention,
        implementation=kernel_platform.name,
        **_launch(kernel_platform, q, kp, scales.get("k_scale")),
    )
    put = {n: kernel_platform.put(x) for n, x in scales.items()}
    o = jax.jit(functools.partial(fn, **put))(*kernel_platform.put(q, kp, kp, bt, kl))
    assert np.all(np.isnan(np.asarray(o, np.float32)))


def test_vmap(kernel_platform, rng):
    kp, vp, bt, kl = make_cache(rng, [9, 70, 33], 16, 2, 64, jnp.float32)
    qs = randn(rng, (4, 3, 6, 64), jnp.float32)

    launch = _launch(kernel_platform, qs[0], kp)

    def attn(impl, q, kp, vp, bt, kl, **kw):
        return jax_flash.paged_attention(q, kp, vp, bt, kl, num_splits=2, implementation=impl, **kw)

    def run(in_axes, *args):
        attn_p = functools.partial(attn, kernel_platform.name, **launch)
        out = jax.jit(jax.vmap(attn_p, in_axes=in_axes))(*kernel_platform.put(*args))
        ref = jax.vmap(functools.partial(attn, "xla"), in_axes=in_axes)(*_cpu(*args))
        assert rel_err(out, ref) <= tolerance(jnp.float32, 0.0)

    run((0, None, None, None, None), qs, kp, vp, bt, kl)  # q only: folds into heads
    bts = jnp.stack([bt, bt[::-1], bt])
    kls = jnp.stack([kl, kl[::-1], kl.at[0].set(0)])
    run((1, None, None, 0, 0), qs[:, :3].transpose(1, 0, 2, 3)[:, :3], kp, vp, bts, kls)
    kps, vps = jnp.stack([kp, kp * 2, -kp]), jnp.stack([vp, vp + 1, vp])
    kls = jnp.stack([kl, kl // 2, kl.at[0].set(0)])
    run((0, 0, 0, None, 0), qs[:3], kps, vps, bt, kls)  # separate caches


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("implementation", [None, "cpu", "xla"])
def test_empty_batch(rng, implementation, sq):
    """B = 0 gives empty results on every path (the split heuristic divided by the CTA count)."""
    kp, vp, bt, kl = make_cache(rng, [5], 16, 2, 64, jnp.float32)
    q = randn(rng, (0, sq, 4, 64), jnp.float32)
    o, lse = jax_flash.paged_attention(
        q, kp, vp, bt[:0], kl[:0], return_lse=True, implementation=implementation
    )
    assert o.shape == (0, sq, 4, 64) and lse.shape == (0, 4, sq)


@pytest.mark.parametrize("opts", [{}, {"sliding_window": (5, 0)}], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_masked_keys_contribute_nothing(kernel_platform, rng, request, opts, dtype):
    """A NaN in v at a key that a query row cannot see (causal: past the row's position; window:
    before its start, in the same tile as visible keys) leaves that row finite; rows that see the
    key get NaN. The CUDA kernels weight such a key by exactly 0, and 0 * NaN is NaN: documented
    (README), expected to fail there."""
    if kernel_platform.name == "cuda":
        request.applymarker(
            pytest.mark.xfail(
                reason="CUDA paged kernels multiply masked keys' v by p = 0 (documented)"
            )
        )
    Sq, Hkv, G, D, page = 4, 2, 3, 64, 8
    lens = [23, 41]
    kp, vp, bt, kl = make_cache(rng, lens, page, Hkv, D, dtype)
    q = randn(rng, (len(lens), Sq, Hkv * G, D), dtype)
    bad = [(0, lens[0] - 1), (1, lens[1] - 2)]  # seen by the last 1 / 2 rows only (causal)
    if opts:
        bad = [(0, lens[0] - Sq - 5), (1, lens[1] - Sq - 4)]  # before the later rows' windows
    vp_nan, vp_zero = np.array(vp, np.float32), np.array(vp, np.float32)
    for b, t in bad:
        page_id, off = int(bt[b, t // page]), t % page
        vp_nan[page_id, off] = np.nan
        vp_zero[page_id, off] = 0.0
    vp_nan, vp_zero = jnp.asarray(vp_nan, dtype), jnp.asarray(vp_zero, dtype)
    o = jax_flash.paged_attention(
        *kernel_platform.put(q, kp, vp_nan, bt, kl), implementation=kernel_platform.name,
        **_launch(kernel_platform, q, kp), **opts,
    )  # fmt: skip
    ref = reference.paged_attention(q, kp, vp_zero, bt, kl, **opts)
    o, ref = np.asarray(o, np.float32), np.asarray(ref, np.float32)
    for b, t in bad:
        for i in range(Sq):
            lo, hi = 0, lens[b] - Sq + i + 1  # keys [lo, hi) visible to query position i
            if opts:
                lo = hi - 1 - opts["sliding_window"][0]
            if lo <= t < hi:
                assert np.all(np.isnan(o[b, i])), (b, i)
            else:
                assert np.all(np.isfinite(o[b, i])), (b, i)
                err = rel_err(o[b, i], ref[b, i])
                assert err <= tolerance(dtype, 0.0), (b, i, err)


def test_launch_options(rng):
    """The private launch options: a kernel name is checked, and asking for the tensor-core
    kernel where it cannot run raises instead of running the other kernel."""
    kp, vp, bt, kl = make_cache(rng, [9], 16, 2, 64, jnp.float32)
    q = randn(rng, (1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        jax_flash.paged_attention(q, kp, vp, bt, kl, _launch=PagedLaunch(kernel="tensor"))
    with pytest.raises(ValueError, match="tensor-core kernel was asked for.*float32"):
        jax_flash.paged_attention(q, kp, vp, bt, kl, _launch=PagedLaunch(kernel="tensor_core"))
    with pytest.raises(TypeError, match="PagedLaunch"):
        jax_flash.paged_attention(q, kp, vp, bt, kl, _launch="cuda_core")
    # Launch options change nothing on the CPU kernel.
    q, kp, vp, bt, kl = jax.device_put((q, kp, vp, bt, kl), jax.devices("cpu")[0])
    ref = jax_flash.paged_attention(q, kp, vp, bt, kl, implementation="cpu")
    for launch in (PagedLaunch("cuda_core", pdl=False), PagedLaunch("auto", merge_pdl=False)):
        o = jax_flash.paged_attention(q, kp, vp, bt, kl, implementation="cpu", _launch=launch)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(ref))


# ---------------------------------------------------------------------------------------------
# cache writes


@pytest.mark.parametrize(
    "cache_dtype,scale", [("bfloat16", None), ("int8", "head"), ("int8", "token"),
                          ("float8_e4m3fn", "head"), ("float8_e4m3fn", "token")]
)  # fmt: skip
def test_append_then_attend(platform, rng, cache_dtype, scale):
    P, page, Hkv, D = 12, 8, 2, 64
    cdt = jnp.dtype(cache_dtype)
    kp = jnp.zeros((P, page, Hkv, D), cdt)
    vp = jnp.zeros((P, page, Hkv, D), cdt)
    ks = vs = None
    if scale == "head":
        ks, vs = jnp.array([0.02, 0.03], jnp.float32), jnp.array([0.025, 0.0], jnp.float32)
    elif scale == "token":
        ks = vs = jnp.zeros((P, page, Hkv), jnp.float32)
    bt = jnp.asarray(rng.permutation(P)[:10].reshape(2, 5).astype(np.int32))
    lens = np.array([13, 29], np.int32)
    pos = np.concatenate([np.arange(n) for n in lens])
    seq = np.concatenate([np.full(n, b) for b, n in enumerate(lens)])
    slots = bt[seq, pos // page] * page + pos % page
    slots = jnp.concatenate([slots, jnp.array([-1, P * page, 10**6], jnp.int32)])  # skipped
    T = slots.shape[0]
    kn = randn(rng, (T, Hkv, D), jnp.bfloat16)
    vn = randn(rng, (T, Hkv, D), jnp.bfloat16)
    kw = {} if ks is None else {"k_scale": ks, "v_scale": vs}
    out = jax.jit(functools.partial(jax_flash.append_kv, implementation=platform.name))(
        *platform.put(kp, vp, kn, vn, slots), **{n: platform.put(x) for n, x in kw.items()}
    )
    ref = reference.append_kv(*_cpu(kp, vp, kn, vn, slots), **kw)
    for got, want in zip(out, ref, strict=False):
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
        )
    if len(out) == 2:
        out = (*out, None, None)
    q = randn(rng, (2, 4, 64), jnp.bfloat16)
    _check(platform, rng, q, out[0], out[1], bt, jnp.asarray(lens), k_scale=out[2], v_scale=out[3])


def test_append_is_in_place(rng):
    P, page, H, D = 64, 16, 4, 128
    kp = jnp.zeros((P, page, H, D), jnp.bfloat16)
    vp = jnp.zeros((P, page, H, D), jnp.bfloat16)
    kn = vn = jnp.ones((3, H, D), jnp.bfloat16)
    f = jax.jit(jax_flash.append_kv, donate_argnums=(0, 1))
    compiled = f.lower(kp, vp, kn, vn, jnp.array([1, 2, 3], jnp.int32)).compile()
    hlo = compiled.as_text()
    assert 'custom_call_target="jax_flash_append_kv_' in hlo
    assert "output_to_operand_aliasing" in hlo
    mem = compiled.memory_analysis()
    cache_bytes = kp.size * kp.dtype.itemsize
    assert mem.temp_size_in_bytes < cache_bytes // 4, mem  # no copy of the cache
    assert mem.alias_size_in_bytes >= 2 * cache_bytes, mem


def test_copy_pages_and_reorder_beams(platform, rng):
    page, Hkv, D = 4, 2, 64
    kp, vp, bt, kl = make_cache(rng, [6, 6, 6], page, Hkv, D, jnp.float32, spare=6)
    P = kp.shape[0]
    used = set(np.asarray(bt)[np.asarray(bt) >= 0].tolist())
    spare = jnp.asarray([p for p in range(P) if p not in used][:3], jnp.int32)
    beam_ids = jnp.array([2, 0, 2], jnp.int32)
    fn = jax.jit(functools.partial(jax_flash.reorder_beams, implementation=platform.name))
    bt2, kl2, spare2, (kp2, vp2) = fn(*platform.put(bt, kl, beam_ids, spare, kp, vp))
    bt2, kl2, spare2 = (np.asarray(x) for x in (bt2, kl2, spare2))
    bt_np = np.asarray(bt)
    for i, p in enumerate(np.asarray(beam_ids)):
        assert bt2[i, 0] == bt_np[p, 0], "full pages are shared"
        assert bt2[i, 1] == int(spare[i]), "the partial page is copied to the beam's spare page"
        np.testing.assert_array_equal(np.asarray(kp2)[bt2[i, 1]], np.asarray(kp)[bt_np[p, 1]])
    assert sorted(spare2.tolist()) == sorted(bt_np[:, 1].tolist())
    # Attention over the reordered beams equals attention over their parents.
    q = randn(rng, (3, 4, D), jnp.float32)
    after = jax_flash.paged_attention(q, kp2, vp2, jnp.asarray(bt2), jnp.asarray(kl2),
                                      implementation="xla")  # fmt: skip
    before = jax_flash.paged_attention(q, kp, vp, bt[beam_ids], kl[beam_ids], implementation="xla")
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=1e-6, atol=1e-6)
    # copy_pages skips out-of-range pairs
    out = jax.jit(functools.partial(jax_flash.copy_pages, implementation=platform.name))(
        *platform.put(kp, vp, jnp.array([0, -1, 3]), jnp.array([1, 2, P]))
    )
    ref = reference.copy_pages(*_cpu(kp, vp, jnp.array([0, -1, 3]), jnp.array([1, 2, P])))
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))


def test_append_vmap(platform, rng):
    kp = randn(rng, (3, 5, 4, 2, 32), jnp.float32)
    vp = randn(rng, (3, 5, 4, 2, 32), jnp.float32)
    kn = randn(rng, (3, 6, 2, 32), jnp.float32)
    # Distinct slots per instance (duplicates have no defined winner), some skipped.
    slots = np.stack([rng.permutation(22)[:6] for _ in range(3)]).astype(np.int32)
    slots[:, 0] = [-2, 21, 20 * 1000]
    slots = jnp.asarray(slots)

    def f(impl, kp, vp, kn, slots):
        return jax_flash.append_kv(kp, vp, kn, kn, slots, implementation=impl)

    out = jax.jit(jax.vmap(functools.partial(f, platform.name)))(*platform.put(kp, vp, kn, slots))
    ref = jax.vmap(functools.partial(f, "xla"))(*_cpu(kp, vp, kn, slots))
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((_z(2, 64), _z(4, 16, 2, 64), _z(4, 16, 2, 64)), {}, ValueError, "q must be"),
        ((_z(2, 4, 64), _z(4, 16, 2), _z(4, 16, 2, 64)), {}, ValueError, "k_pages must have rank"),
        ((_z(2, 4, 64), _z(4, 16, 2, 32), _z(4, 16, 2, 32)), {}, ValueError, "head dim 32"),
        ((_z(2, 5, 64), _z(4, 16, 2, 64), _z(4, 16, 2, 64)), {}, ValueError, r"query heads \(5\)"),
        ((_z(2, 4, 64), _z(4, 16, 2, 64, dtype=jnp.float16), _z(4, 16, 2, 64, dtype=jnp.float16)),
         {}, TypeError, "dtype of the queries"),
        ((_z(2, 4, 64), _z(4, 16, 2, 64, dtype=jnp.int8), _z(4, 16, 2, 64, dtype=jnp.int8)), {},
         ValueError, "needs k_scale"),
        ((_z(2, 4, 64), _z(4, 16, 2, 64, dtype=jnp.int8), _z(4, 16, 2, 64, dtype=jnp.int8)),
         {"k_scale": _z(3), "v_scale": _z(3)}, ValueError, r"k_scale must have shape \(2,\)"),
        ((_z(2, 4, 64), _z(4, 16, 2, 64), _z(4, 16, 2, 64)), {"num_splits": 0}, ValueError,
         "num_splits"),
    ],
)  # fmt: skip
def test_errors(args, kwargs, exc, match):
    bt = jnp.zeros((2, 3), jnp.int32)
    kl = jnp.zeros((2,), jnp.int32)
    with pytest.raises(exc, match=match):
        jax_flash.paged_attention(*args, bt, kl, **kwargs)
    with pytest.raises(ValueError, match="block_tables"):
        jax_flash.paged_attention(_z(2, 4, 64), _z(4, 16, 2, 64), _z(4, 16, 2, 64), bt[:1], kl)
    with pytest.raises(ValueError, match="slot_mapping"):
        jax_flash.append_kv(_z(4, 16, 2, 64), _z(4, 16, 2, 64), _z(3, 2, 64), _z(3, 2, 64),
                            jnp.zeros((2,), jnp.int32))  # fmt: skip
