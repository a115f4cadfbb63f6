"""append_kv with the fused RoPE (positions=, rope=, q=) against apply_rope then append_kv:
bit-equal on every platform, and against the jnp reference path; append_qkv (the same call
from packed q/k/v rows) against append_kv of the slices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference

from _util import DTYPES, LINEAR, LLAMA3, randn, rel_err, tolerance

CACHES = [("same", None), ("int8", "head"), ("int8", "token"), ("float8_e4m3fn", "head"),
          ("float8_e4m3fn", "token")]  # fmt: skip


def _cpu(*xs):
    cpu = jax.devices("cpu")[0]
    return [None if x is None else jax.device_put(x, cpu) for x in xs]


def _bits(x):
    return np.asarray(x).view(np.uint8)


def make_case(rng, dtype, cache, scale, *, T=37, Hkv=3, Hq=6, D=64, P=11, page=8):
    """Random cache (garbage in it, so an unwritten or wrongly written slot shows), new rows,
    distinct slots with skipped ones (-1, past the end, huge) and arbitrary positions."""
    cdt = dtype if cache == "same" else jnp.dtype(cache)
    kp = randn(rng, (P, page, Hkv, D), dtype).astype(cdt)
    vp = randn(rng, (P, page, Hkv, D), dtype).astype(cdt)
    scales = {}
    if scale == "head":
        qmax = reference.QMAX[cache]
        ks = jnp.asarray(rng.uniform(2.0, 4.0, Hkv) / qmax, jnp.float32)
        vs = jnp.asarray(rng.uniform(2.0, 4.0, Hkv) / qmax, jnp.float32).at[1].set(0.0)
        scales = {"k_scale": ks, "v_scale": vs}
    elif scale == "token":
        s = jnp.asarray(rng.uniform(0.0, 0.1, (P, page, Hkv)), jnp.float32)
        scales = {"k_scale": s, "v_scale": s * 2}
    slots = rng.permutation(P * page)[:T].astype(np.int32)
    slots[[0, T // 2, T - 1]] = [-1, P * page, 10**6]  # skipped
    slots = jnp.asarray(slots)
    positions = rng.integers(-100, 200_000, size=T).astype(np.int32)
    positions[[1, 2]] = [2**24 - 1, 0]
    positions = jnp.asarray(positions)
    kn = randn(rng, (T, Hkv, D), dtype)
    vn = randn(rng, (T, Hkv, D), dtype)
    q = randn(rng, (T, Hq, D), dtype)
    return kp, vp, kn, vn, slots, positions, q, scales


def fused(platform_name, rope, kp, vp, kn, vn, slots, positions, q, **scales):
    return jax_flash.append_kv(
        kp, vp, kn, vn, slots, positions=positions, rope=rope, q=q,
        implementation=platform_name, **scales,
    )  # fmt: skip


def unfused(platform_name, rope, kp, vp, kn, vn, slots, positions, q, **scales):
    impl = {"implementation": platform_name}
    k_rot = jax_flash.apply_rope(kn, positions, **rope, **impl)
    caches = jax_flash.append_kv(kp, vp, k_rot, vn, slots, **scales, **impl)
    q_rot = None if q is None else jax_flash.apply_rope(q, positions, **rope, **impl)
    return caches if q is None else (q_rot, *caches)


def _run(fn, platform, rope, kp, vp, kn, vn, slots, positions, q, scales):
    put = platform.put if hasattr(platform, "put") else (lambda *x: x if len(x) > 1 else x[0])
    name = platform.name if hasattr(platform, "name") else platform
    f = jax.jit(functools.partial(fn, name, rope))
    args = put(kp, vp, kn, vn, slots, positions)
    qq = None if q is None else put(q)
    return f(*args, qq, **{n: put(x) for n, x in scales.items()})


ROPES = [
    ("neox", {"style": "neox", "theta": 500000.0, "scaling": LLAMA3}, 64),
    ("gptj", {"style": "gptj", "rotary_dim": 48, "scaling": LINEAR}, 128),
    ("neox-partial", {"rotary_dim": 32, "theta": 10000.0}, 128),
    ("gptj-d64", {"style": "gptj", "theta": 1e6, "scaling": LLAMA3}, 64),
]


@pytest.mark.parametrize("cache,scale", CACHES, ids=[f"{c}-{s}" for c, s in CACHES])
@pytest.mark.parametrize("rope_id,rope,D", ROPES, ids=[r[0] for r in ROPES])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_bit_equal(platform, rng, dtype, rope_id, rope, D, cache, scale):
    kp, vp, kn, vn, slots, positions, q, scales = make_case(rng, DTYPES[dtype], cache, scale, D=D)
    args = (rope, kp, vp, kn, vn, slots, positions, q, scales)
    got = _run(fused, platform, *args)
    want = _run(unfused, platform, *args)
    n = 5 if scales else 3
    assert len(got) == len(want) == n
    names = ("q", "k_pages", "v_pages", "k_scale", "v_scale")[:n]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{platform}: {name}")
    # Skipped slots left the garbage alone; written slots hold something else.
    flat = np.asarray(got[1]).reshape(-1, *kp.shape[2:]).view(np.uint8)
    before = np.asarray(kp).reshape(-1, *kp.shape[2:]).view(np.uint8)
    s = np.asarray(slots)
    ok = (s >= 0) & (s < flat.shape[0])
    untouched = np.setdiff1d(np.arange(flat.shape[0]), s[ok])
    np.testing.assert_array_equal(flat[untouched], before[untouched])


@pytest.mark.parametrize("cache,scale", CACHES, ids=[f"{c}-{s}" for c, s in CACHES])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_no_queries(platform, rng, dtype, cache, scale):
    kp, vp, kn, vn, slots, positions, _, scales = make_case(
        rng, DTYPES[dtype], cache, scale, T=9, Hkv=2, D=64
    )
    rope = {"style": "gptj", "scaling": LINEAR}
    args = (rope, kp, vp, kn, vn, slots, positions, None, scales)
    got = _run(fused, platform, *args)
    want = _run(unfused, platform, *args)
    assert len(got) == (4 if scales else 2)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("cache,scale", CACHES, ids=[f"{c}-{s}" for c, s in CACHES])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_xla_reference(platform, rng, dtype, cache, scale):
    """The "xla" path is apply_rope then append_kv of the jnp reference, bit for bit; the native
    kernels agree with it up to the float32 cos/sin of each library."""
    rope = {"style": "neox", "rotary_dim": 48, "theta": 500000.0, "scaling": LLAMA3}
    case = make_case(rng, DTYPES[dtype], cache, scale)
    kp, vp, kn, vn, slots, positions, q, scales = case
    ref = _run(fused, "xla", rope, *case[:-1], scales)
    ref_unfused = _run(unfused, "xla", rope, *case[:-1], scales)
    for a, b in zip(ref, ref_unfused, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    got = _cpu(*_run(fused, platform, rope, *case[:-1], scales))
    ref = _cpu(*ref)
    atol = tolerance(DTYPES[dtype], 0.0)
    assert rel_err(got[0], ref[0]) <= atol  # q_rot
    if scale is None:
        assert rel_err(got[1], ref[1]) <= atol
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))
        return
    # Quantized: a rotated value one float32 ulp apart may round to the neighbouring code (and
    # move a per-token amax by one unit of the input dtype); nothing more.
    qmax = reference.QMAX[cache]
    for a, b in ((got[1], ref[1]), (got[2], ref[2])):
        fa, fb = (np.asarray(jnp.asarray(x).astype(jnp.float32)) for x in (a, b))
        step = 2.0 if cache == "int8" else 0.125 * np.maximum(np.abs(fb), 2.0**-6) + 2.0**-9
        assert np.all(np.abs(fa - fb) <= step + 1e-6)
        assert np.mean(fa != fb) < 0.02
    for a, b in ((got[3], ref[3]), (got[4], ref[4])):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=4 * float(jnp.finfo(DTYPES[dtype]).eps) + 1e-6,
            atol=1e-30,
        )  # fmt: skip
    del qmax


@pytest.mark.parametrize("scale", ["head", "token"])
def test_vmap(platform, rng, scale):
    B = 3
    cases = [make_case(rng, jnp.bfloat16, "int8", scale, T=7, Hkv=2, Hq=4, P=5, page=4)
             for _ in range(B)]  # fmt: skip
    stacked = [jnp.stack([c[i] for c in cases]) for i in range(7)]
    ks = jnp.stack([c[7]["k_scale"] for c in cases])
    vs = jnp.stack([c[7]["v_scale"] for c in cases])
    rope = {"rotary_dim": 32, "scaling": LLAMA3}

    def f(kp, vp, kn, vn, slots, positions, q, ks, vs):
        return fused(platform.name, rope, kp, vp, kn, vn, slots, positions, q, k_scale=ks,
                     v_scale=vs)  # fmt: skip

    out = jax.jit(jax.vmap(f))(*platform.put(*stacked, ks, vs))
    for b in range(B):
        one = jax.jit(f)(*platform.put(*[x[b] for x in stacked], ks[b], vs[b]))
        for a, c in zip(out, one, strict=True):
            np.testing.assert_array_equal(_bits(a[b]), _bits(c))
    # Shared queries and positions (not mapped), separate caches.
    kp, vp, kn, vn, slots, positions, q = stacked
    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, 0, None, None, 0, 0)))(
        *platform.put(kp, vp, kn, vn, slots, positions[0], q[0], ks, vs)
    )
    one = jax.jit(f)(
        *platform.put(kp[2], vp[2], kn[2], vn[2], slots[2], positions[0], q[0], ks[2], vs[2])
    )
    for a, c in zip(out, one, strict=True):
        np.testing.assert_array_equal(_bits(a[2]), _bits(c))


def test_in_place(rng):
    P, page, H, D = 64, 16, 4, 128
    kp = jnp.zeros((P, page, H, D), jnp.bfloat16)
    vp = jnp.zeros((P, page, H, D), jnp.bfloat16)
    kn = vn = jnp.ones((3, H, D), jnp.bfloat16)
    q = jnp.ones((3, 2 * H, D), jnp.bfloat16)

    def step(kp, vp, kn, vn, slots, pos, q):
        return jax_flash.append_kv(kp, vp, kn, vn, slots, positions=pos, rope={}, q=q)

    f = jax.jit(step, donate_argnums=(0, 1))
    args = (kp, vp, kn, vn, jnp.array([1, 2, 3], jnp.int32), jnp.array([5, 6, 7]), q)
    compiled = f.lower(*args).compile()
    hlo = compiled.as_text()
    assert 'custom_call_target="jax_flash_append_kv_rope_' in hlo
    assert "jax_flash_apply_rope" not in hlo  # one kernel
    assert "output_to_operand_aliasing" in hlo
    mem = compiled.memory_analysis()
    cache_bytes = kp.size * kp.dtype.itemsize
    assert mem.temp_size_in_bytes < cache_bytes // 4, mem
    assert mem.alias_size_in_bytes >= 2 * cache_bytes, mem


def test_empty(platform):
    kp = vp = jnp.zeros((4, 8, 2, 64), jnp.float16)
    kn = vn = jnp.zeros((0, 2, 64), jnp.float16)
    q = jnp.zeros((0, 4, 64), jnp.float16)
    kp, vp, kn, vn, slots, pos, q = platform.put(
        kp, vp, kn, vn, jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32), q
    )
    out = jax_flash.append_kv(
        kp, vp, kn, vn, slots, positions=pos, rope={}, q=q, implementation=platform.name
    )
    assert out[0].shape == (0, 4, 64) and out[1].shape == kp.shape


@pytest.mark.skipif(not jax_flash.has_cuda_kernels(), reason="built without CUDA kernels")
def test_cuda_lowering_without_gpu():
    kp = vp = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    kn = vn = jnp.zeros((3, 2, 64), jnp.bfloat16)

    def f(kp, vp, kn, vn, slots, pos):
        return jax_flash.append_kv(kp, vp, kn, vn, slots, positions=pos, rope={"style": "gptj"})

    args = (kp, vp, kn, vn, jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_flash_append_kv_rope_cuda" in text


def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


_POS = _z(3, dtype=jnp.int32)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"positions": _POS}, ValueError, "positions is given but rope is None"),
        ({"rope": {}}, ValueError, "rope is given but positions is None"),
        ({"q": _z(3, 4, 64)}, ValueError, "q is only taken with the fused RoPE"),
        ({"positions": _POS, "rope": [1]}, TypeError, "rope must be a dict"),
        ({"positions": _POS, "rope": {"base": 1.0}}, ValueError, r"unknown keys \['base'\]"),
        ({"positions": _z(4, dtype=jnp.int32), "rope": {}}, ValueError,
         r"positions must have shape \(3,\)"),
        ({"positions": _z(3), "rope": {}}, TypeError, "positions must be an integer array"),
        ({"positions": _POS, "rope": {"style": "llama"}}, ValueError, r"rope\['style'\]"),
        ({"positions": _POS, "rope": {"rotary_dim": 7}}, ValueError,
         r"rope\['rotary_dim'\] must be even"),
        ({"positions": _POS, "rope": {"rotary_dim": 66}}, ValueError, r"\[2, D=64\]"),
        ({"positions": _POS, "rope": {"theta": -1.0}}, ValueError, r"rope\['theta'\]"),
        ({"positions": _POS, "rope": {"scaling": {"type": "yarn"}}}, ValueError,
         r"rope\['scaling'\]\['type'\]"),
        ({"positions": _POS, "rope": {}, "q": _z(3, 4)}, ValueError, "q must have rank 3"),
        ({"positions": _POS, "rope": {}, "q": _z(3, 4, 64, dtype=jnp.float16)}, TypeError,
         "q has dtype float16, expected k_new's float32"),
        ({"positions": _POS, "rope": {}, "q": _z(4, 4, 64)}, ValueError,
         r"q must have shape \[T, Hq, D\] = \[3, Hq, 64\]"),
        ({"positions": _POS, "rope": {}, "q": _z(3, 4, 32)}, ValueError, "q must have shape"),
        ({"positions": _POS, "rope": {}, "q": _z(3, 3, 64)}, ValueError,
         r"query heads \(3\) must be a positive multiple.*\(2\)"),
        ({"positions": _POS, "rope": {}, "implementation": "triton"}, ValueError,
         "implementation"),
    ],
)  # fmt: skip
def test_errors(kwargs, exc, match):
    kp = vp = _z(4, 8, 2, 64)
    kn = vn = _z(3, 2, 64)
    with pytest.raises(exc, match=match):
        jax_flash.append_kv(kp, vp, kn, vn, _z(3, dtype=jnp.int32), **kwargs)


def test_rotary_dim_beyond_native_kernels():
    kp = vp = _z(4, 8, 1, 1024)
    kn = vn = _z(2, 1, 1024)
    args = (kp, vp, kn, vn, jnp.array([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="up to 512.*implementation='xla'"):
        jax_flash.append_kv(*args, positions=jnp.array([3, 4]), rope={})
    out = jax_flash.append_kv(*args, positions=jnp.array([3, 4]), rope={}, implementation="xla")
    assert out[0].shape == kp.shape


@pytest.mark.parametrize("rope", [None, {"style": "gptj"}])
def test_vmap_per_head_scales(platform, rng, rope):
    """Per-head scales under vmap: mapped (each instance its own: one call per instance) and
    shared (one call for all), for append_kv with and without the fused RoPE."""
    B, T = 3, 7
    cases = [make_case(rng, jnp.float16, "float8_e4m3fn", "head", T=T, Hkv=2, Hq=2, P=5, page=4)
             for _ in range(B)]  # fmt: skip
    kp, vp, kn, vn, slots, positions, _ = (jnp.stack([c[i] for c in cases]) for i in range(7))
    ks = jnp.stack([c[7]["k_scale"] for c in cases])
    vs = jnp.stack([c[7]["v_scale"] for c in cases])
    extra = {} if rope is None else {"rope": rope}

    def f(kp, vp, kn, vn, slots, positions, ks, vs):
        pos = {} if rope is None else {"positions": positions}
        return jax_flash.append_kv(kp, vp, kn, vn, slots, k_scale=ks, v_scale=vs,
                                   implementation=platform.name, **pos, **extra)  # fmt: skip

    args = platform.put(kp, vp, kn, vn, slots, positions, ks, vs)
    for in_axes, b_scale in (((0,) * 8, None), ((0,) * 6 + (None, None), 1)):
        call = args if b_scale is None else (*args[:6], args[6][b_scale], args[7][b_scale])
        out = jax.jit(jax.vmap(f, in_axes=in_axes))(*call)
        for b in range(B):
            sb = b if b_scale is None else b_scale
            one = jax.jit(f)(*[x[b] for x in args[:6]], args[6][sb], args[7][sb])
            for a, c in zip(out, one, strict=True):
                np.testing.assert_array_equal(_bits(a[b]), _bits(c))


# append_qkv: the same call reading packed q/k/v rows [T, Hkv, G + 2, D].


def _pack(q, kn, vn):
    T, Hkv, D = kn.shape
    G = q.shape[1] // Hkv
    return jnp.concatenate([q.reshape(T, Hkv, G, D), kn[:, :, None], vn[:, :, None]], axis=2)


def packed(platform_name, rope, kp, vp, kn, vn, slots, positions, q, **scales):
    return jax_flash.append_qkv(
        kp, vp, _pack(q, kn, vn), slots, positions, rope=rope, implementation=platform_name,
        **scales,
    )  # fmt: skip


# (Hkv, Hq): groups of 3 (query heads of one item span two kv heads), 1 (MHA) and 4.
PACKED_HEADS = [(3, 9), (4, 4), (2, 8)]


@pytest.mark.parametrize("cache,scale", CACHES, ids=[f"{c}-{s}" for c, s in CACHES])
@pytest.mark.parametrize("heads", PACKED_HEADS, ids=[f"{h}/{g}" for h, g in PACKED_HEADS])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_packed_bit_equal(platform, rng, dtype, heads, cache, scale):
    """append_qkv equals append_kv of the sliced rows bit for bit (which equals apply_rope then
    append_kv: test_fused_bit_equal), the "xla" path included."""
    h, c = PACKED_HEADS.index(heads), CACHES.index((cache, scale))
    if platform.name == "cpu" and c != (list(DTYPES).index(dtype) + h) % len(CACHES):
        # The CPU kernel copies packed rows apart, then runs the code test_fused_bit_equal checks
        # for every cache: one cache per dtype and head split (each cache type at least once).
        pytest.skip("packed rows on the CPU kernel: one cache per dtype and head split")
    Hkv, Hq = heads
    rope_id, rope, D = ROPES[h]  # both styles, partial rotation
    case = make_case(rng, DTYPES[dtype], cache, scale, T=23, Hkv=Hkv, Hq=Hq, D=D)
    args = (rope, *case[:7], case[7])
    want = _run(fused, platform, *args)
    got = _run(packed, platform, *args)
    xla, xla_want = _run(packed, "xla", *args), _run(fused, "xla", *args)
    assert len(got) == len(want) == len(xla) == (5 if scale else 3)
    names = ("q", "k_pages", "v_pages", "k_scale", "v_scale")
    for name, a, b, c, d in zip(names, got, want, xla, xla_want, strict=False):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{platform} {rope_id}: {name}")
        np.testing.assert_array_equal(_bits(c), _bits(d), err_msg=f"xla: {name}")


def test_packed_vmap(platform, rng):
    B = 3
    cases = [make_case(rng, jnp.bfloat16, "int8", "token", T=7, Hkv=2, Hq=6, P=5, page=4)
             for _ in range(B)]  # fmt: skip
    kp, vp, kn, vn, slots, positions, q = (jnp.stack([c[i] for c in cases]) for i in range(7))
    ks = jnp.stack([c[7]["k_scale"] for c in cases])
    vs = jnp.stack([c[7]["v_scale"] for c in cases])
    qkv = jax.vmap(_pack)(q, kn, vn)
    rope = {"rotary_dim": 32, "scaling": LLAMA3}

    def f(kp, vp, qkv, slots, positions, ks, vs):
        return jax_flash.append_qkv(kp, vp, qkv, slots, positions, rope=rope, k_scale=ks,
                                    v_scale=vs, implementation=platform.name)  # fmt: skip

    args = platform.put(kp, vp, qkv, slots, positions, ks, vs)
    out = jax.jit(jax.vmap(f))(*args)
    for b in range(B):
        one = jax.jit(f)(*[x[b] for x in args])
        for a, c in zip(out, one, strict=True):
            np.testing.assert_array_equal(_bits(a[b]), _bits(c))


def test_packed_reads_rows_in_place(rng):
    """The packed rows go to the kernel as they are: no slice of them in the compiled program."""
    kp = vp = jnp.zeros((16, 16, 2, 64), jnp.bfloat16)
    qkv = randn(rng, (5, 2, 6, 64), jnp.bfloat16)

    def step(kp, vp, qkv, slots, pos):
        return jax_flash.append_qkv(kp, vp, qkv, slots, pos, rope={})

    args = (kp, vp, qkv, jnp.arange(5, dtype=jnp.int32), jnp.arange(5, dtype=jnp.int32))
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    assert 'custom_call_target="jax_flash_append_qkv_rope_' in hlo
    assert " slice(" not in hlo and "output_to_operand_aliasing" in hlo


@pytest.mark.skipif(not jax_flash.has_cuda_kernels(), reason="built without CUDA kernels")
def test_packed_cuda_lowering_without_gpu():
    kp = vp = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    qkv = jnp.zeros((3, 2, 5, 64), jnp.bfloat16)

    def f(kp, vp, qkv, slots, pos):
        return jax_flash.append_qkv(kp, vp, qkv, slots, pos, rope={"style": "gptj"})

    args = (kp, vp, qkv, jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_flash_append_qkv_rope_cuda" in text


@pytest.mark.parametrize(
    "qkv,pages,kwargs,exc,match",
    [
        (_z(3, 2, 64), None, {}, ValueError, r"qkv must have rank 4 \[T, Hkv, G \+ 2, D\]"),
        (_z(3, 2, 2, 64), None, {}, ValueError, r"at least one query head per kv head"),
        (_z(3, 2, 6, 64, dtype=jnp.int32), None, {}, TypeError, "qkv"),
        (_z(3, 3, 6, 64), None, {}, ValueError, "does not match the pages"),
        (_z(3, 2, 6, 64), (_z(4, 8, 2, 64), _z(4, 8, 2, 32)), {}, ValueError, "D == Dv"),
        (_z(3, 2, 6, 64, dtype=jnp.float16), None, {}, TypeError, "float16"),
        (_z(3, 2, 6, 64), None, {"positions": _z(4, dtype=jnp.int32)}, ValueError,
         r"positions must have shape \(3,\)"),
        (_z(3, 2, 6, 64), None, {"rope": None}, ValueError, "rope is None"),
        (_z(3, 2, 6, 64), None, {"slot_mapping": _z(2, dtype=jnp.int32)}, ValueError,
         r"slot_mapping must have shape \(3,\)"),
    ],
)  # fmt: skip
def test_packed_errors(qkv, pages, kwargs, exc, match):
    kp, vp = pages or (_z(4, 8, 2, 64), _z(4, 8, 2, 64))
    call = {"slot_mapping": _z(3, dtype=jnp.int32), "positions": _POS, "rope": {}, **kwargs}
    with pytest.raises(exc, match=match):
        jax_flash.append_qkv(kp, vp, qkv, call["slot_mapping"], call["positions"],
                             rope=call["rope"])  # fmt: skip
