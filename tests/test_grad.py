"""Gradients of flash_attention / flash_attention_varlen against jax.grad of the float32
reference (jax_flash.reference, highest precision), on every platform: every masking option,
GQA, soft cap, dtypes, the lse cotangent; composition with jit, vmap, remat, value_and_grad;
deterministic mode; and on 4 devices (CPU host devices in a subprocess when fewer are visible)
shard_map, a batch-sharded mesh and context parallelism.

Cotangents are random for both outputs (o and lse), so one vector-Jacobian product checks the
whole backward, the Delta = rowsum(dO * O) - dLSE term included.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import reference

from _util import DTYPES, randn, rel_err, run_on_host_devices, tolerance

NAMES = ("dq", "dk", "dv")


def _vjp(fn, primals, cotangents):
    _, pull = jax.vjp(fn, *primals)
    return pull(cotangents)


def _f32(*xs):
    return [jnp.asarray(x).astype(jnp.float32) for x in xs]


def _cpu(*xs):
    cpu = jax.devices("cpu")[0]
    return [jax.device_put(x, cpu) for x in xs]


def _check(got, ref, same, dtype):
    """got (the kernel's grads) against ref (float32 reference grads); the tolerance scales with
    the error of the same-dtype reference (`same`, None for float32)."""
    for i, name in enumerate(NAMES):
        g, r = got[i], np.asarray(ref[i], np.float64)
        assert g.dtype == dtype, f"{name} has dtype {g.dtype}, expected {dtype}"
        assert np.all(np.isfinite(r)), f"the reference's {name} holds NaN/inf"
        tol = tolerance(dtype, 0.0 if same is None else rel_err(same[i], r))
        err = rel_err(g, r)
        assert err <= tol, f"{name}: relative error {err:.3g} > tolerance {tol:.3g}"


def _grads(platform, rng, fn, ref_fn, q, k, v, cot_shapes, same_dtype=True):
    """The kernel's grads (float32 NumPy arrays) after checking them against the reference.
    fn / ref_fn: (q, k, v) -> (o, lse); with same_dtype, ref_fn takes compute_dtype and the
    tolerance scales with the error of the reference computed in q's dtype, else it is one
    rounding unit of the dtype."""
    dtype = q.dtype
    do = randn(rng, cot_shapes[0], dtype)
    dlse = randn(rng, cot_shapes[1], jnp.float32)
    got = jax.jit(lambda *a: _vjp(fn, a[:3], a[3:]))(*platform.put(q, k, v, do, dlse))
    q, k, v, do, dlse = _cpu(q, k, v, do, dlse)
    ref = jax.jit(lambda *a: _vjp(ref_fn, a[:3], a[3:]))(*_f32(q, k, v, do), dlse)
    same = None
    if same_dtype and dtype != jnp.float32:
        same_fn = functools.partial(ref_fn, compute_dtype=dtype)
        same = jax.jit(lambda *a: _vjp(same_fn, a[:3], a[3:]))(q, k, v, do, dlse)
    _check(got, ref, same, dtype)
    return [np.asarray(g, np.float32) for g in got]


def _dense(platform, rng, B, Sq, Skv, Hq, Hkv, D, dtype, Dv=None, **opts):
    dtype = DTYPES[dtype]
    Dv = D if Dv is None else Dv
    q = randn(rng, (B, Sq, Hq, D), dtype)
    k = randn(rng, (B, Skv, Hkv, D), dtype)
    v = randn(rng, (B, Skv, Hkv, Dv), dtype)
    lens = {n: opts.pop(n) for n in ("q_seqlens", "kv_seqlens") if n in opts}
    fn = functools.partial(
        jax_flash.flash_attention,
        return_lse=True,
        implementation=platform.name,
        **{n: platform.put(x) for n, x in lens.items()},
        **opts,
    )
    ref_fn = functools.partial(reference.attention, return_lse=True, **lens, **opts)
    return _grads(platform, rng, fn, ref_fn, q, k, v, [(B, Sq, Hq, Dv), (B, Hq, Sq)])


@pytest.mark.parametrize(
    "causal,dtype",
    [(False, "float32"), (True, "float32"), (True, "float16"), (False, "bfloat16")],
)
def test_dense(platform, rng, causal, dtype):
    _dense(platform, rng, 2, 97, 97, 4, 2, 64, dtype, causal=causal)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_groups(platform, rng, group):
    # Sq != Skv, so the causal diagonal is bottom-right aligned.
    _dense(platform, rng, 1, 45, 71, 2 * group, 2, 32, "float32", causal=True)


@pytest.mark.parametrize("sq,skv", [(37, 97), (97, 37)])
def test_unequal_lengths(platform, rng, sq, skv):
    dq, dk, dv = _dense(platform, rng, 2, sq, skv, 4, 2, 64, "bfloat16", causal=True)
    if sq > skv:  # the first Sq - Skv rows see no key: zero gradient, never NaN
        assert np.all(dq[:, : sq - skv] == 0)


@pytest.mark.parametrize(
    "window,causal",
    [((16, 0), False), ((16, None), True), ((8, 8), False), ((None, 5), False), ((0, 0), False)],
)
def test_sliding_window(platform, rng, window, causal):
    _dense(platform, rng, 2, 71, 131, 6, 3, 32, "float32", sliding_window=window, causal=causal)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_soft_cap_and_scale(platform, rng, dtype):
    opts = dict(causal=True, logits_soft_cap=5.0, softmax_scale=0.3)
    _dense(platform, rng, 2, 67, 67, 4, 4, 64, dtype, **opts)


def test_seqlens_with_empty_rows(platform, rng):
    q_lens = np.array([0, 5, 37, 37], np.int32)
    kv_lens = np.array([13, 0, 29, 41], np.int32)
    dq, dk, dv = _dense(
        platform, rng, 4, 37, 41, 4, 2, 64, "float16", causal=True,
        q_seqlens=q_lens, kv_seqlens=kv_lens,
    )  # fmt: skip
    for b in range(4):
        assert np.all(dq[b, q_lens[b] :] == 0), "rows past q_seqlens must get zero dq"
        assert np.all(dk[b, kv_lens[b] :] == 0) and np.all(dv[b, kv_lens[b] :] == 0)
    # Sequence 0 has no query row, sequence 1 no key: nothing flows at all.
    for g in (dq, dk, dv):
        assert np.all(g[:2] == 0)


def test_head_dims(platform, rng):
    # Head dims that are no multiple of any vector width, and Dv != D.
    _dense(platform, rng, 1, 53, 29, 3, 1, 80, "float32", Dv=19, causal=True)


@pytest.mark.parametrize("d", [256, 160])
def test_wide_head_dims(platform, rng, d):
    # Gemma's 256 and a narrower multiple of 16 (CUDA: the tensor-core backward's 256-wide tile,
    # zero-padded), GQA, bottom-right causal with Sq != Skv and per-sequence lengths.
    _dense(
        platform, rng, 2, 71, 97, 8, 2, d, "bfloat16", causal=True,
        q_seqlens=np.array([71, 40], np.int32), kv_seqlens=np.array([97, 66], np.int32),
    )  # fmt: skip


def _varlen(platform, rng, dtype, cu_q, cu_k, Tq, Tk, **opts):
    dtype = DTYPES[dtype]
    cu_q, cu_k = jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32)
    Hq, Hkv, D = 4, 2, 64
    q = randn(rng, (Tq, Hq, D), dtype)
    k = randn(rng, (Tk, Hkv, D), dtype)
    v = randn(rng, (Tk, Hkv, D), dtype)
    fn = functools.partial(
        jax_flash.flash_attention_varlen,
        cu_seqlens_q=platform.put(cu_q),
        cu_seqlens_k=platform.put(cu_k),
        return_lse=True,
        implementation=platform.name,
        **opts,
    )

    def ref_fn(q, k, v):
        return reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)

    shapes = [(Tq, Hq, D), (Hq, Tq)]
    return _grads(platform, rng, fn, ref_fn, q, k, v, shapes, same_dtype=False)


@pytest.mark.parametrize(
    "dtype,opts",
    [("float32", {"causal": True}), ("bfloat16", {"sliding_window": (9, 4)})],
)
def test_varlen_with_empty_sequences(platform, rng, dtype, opts):
    # Empty sequences (q, k or both), rows past cu_seqlens_q[-1] and keys past cu_seqlens_k[-1]
    # that no sequence owns: zero gradients there.
    # Sequences: q [0, 0) k [0, 5); q [0, 17) k [5, 5); q [17, 17) k [5, 40);
    # q [17, 90) k [40, 110); q [90, 101) k [110, 110). Only the fourth has gradients.
    cu_q = [0, 0, 17, 17, 90, 101]
    cu_k = [0, 5, 5, 40, 110, 110]
    dq, dk, dv = _varlen(platform, rng, dtype, cu_q, cu_k, 107, 117, **opts)
    assert np.all(dq[:17] == 0) and np.all(dq[90:] == 0)
    assert np.all(dk[:40] == 0) and np.all(dv[:40] == 0)
    assert np.all(dk[110:] == 0) and np.all(dv[110:] == 0)
    assert np.any(dq[17:90] != 0) and np.any(dk[40:110] != 0)


def test_reference_has_no_nan_where_rows_see_no_key(rng):
    # Causal with Sq > Skv (rows without keys), zero lengths: finite, zero gradients there.
    q = randn(rng, (2, 9, 2, 16), jnp.float32)
    k = v = randn(rng, (2, 4, 2, 16), jnp.float32)
    lens = jnp.array([0, 4], jnp.int32)

    def loss(q, k, v):
        o, lse = reference.attention(q, k, v, causal=True, kv_seqlens=lens, return_lse=True)
        return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]
    for g in grads:
        assert np.all(np.isfinite(g))
    assert np.all(grads[0][0] == 0) and np.all(grads[0][1, :5] == 0)


def _loss_inputs(rng, dtype=jnp.float32):
    q = randn(rng, (2, 33, 4, 32), dtype)
    k = randn(rng, (2, 47, 2, 32), dtype)
    v = randn(rng, (2, 47, 2, 32), dtype)
    return q, k, v


def test_lse_and_o_cotangents_alone(platform, rng):
    # Losses on lse only (o's cotangent is a symbolic zero) and on o only (lse's is), through
    # value_and_grad.
    q, k, v = _loss_inputs(rng)

    def lse_loss(impl):
        def f(q, k, v):
            _, lse = jax_flash.flash_attention(
                q, k, v, causal=True, return_lse=True, implementation=impl
            )
            return jnp.sum(jnp.sin(lse))

        return f

    def o_loss(impl):
        return lambda q, k, v: jnp.sum(
            jnp.cos(jax_flash.flash_attention(q, k, v, causal=True, implementation=impl))
        )

    for make in (lse_loss, o_loss):
        val, got = jax.jit(jax.value_and_grad(make(platform.name), argnums=(0, 1, 2)))(
            *platform.put(q, k, v)
        )
        ref_val, ref = jax.jit(jax.value_and_grad(make("xla"), argnums=(0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5)
        _check(got, ref, None, jnp.float32)


def test_vmap_and_grad(platform, rng):
    # grad of vmap and vmap of grad, mapping only q (the forward folds it into heads) or
    # everything (folded into rows), against the unbatched gradient of each instance (itself
    # checked against the reference above).
    q, k, v = _loss_inputs(rng)
    qs = jnp.stack([q, 0.5 * q, q + 1.0])
    ks, vs = jnp.stack([k, -k, 2 * k]), jnp.stack([v, v * v, -v])

    def loss(q, k, v):
        o = jax_flash.flash_attention(q, k, v, causal=True, implementation=platform.name)
        return jnp.sum(o**2)

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    cases = [
        ("vmap of grad, q mapped", jax.vmap(jax.grad(loss, (0, 1, 2)), (0, None, None)),
         (qs, k, v), False),
        ("vmap of grad, all mapped", jax.vmap(jax.grad(loss, (0, 1, 2))), (qs, ks, vs), False),
        ("grad of vmap, q mapped",
         jax.grad(lambda *a: jnp.sum(jax.vmap(loss, (0, None, None))(*a)), (0, 1, 2)),
         (qs, k, v), True),
    ]  # fmt: skip
    for name, transform, args, summed in cases:
        got = jax.jit(transform)(*platform.put(*args))
        per = [grad(*(x[i] if x.ndim == 5 else x for x in platform.put(*args))) for i in range(3)]
        for j, n in enumerate(NAMES):
            want = jnp.stack([p[j] for p in per])
            if summed and args[j].ndim == 4:  # an unmapped operand's gradient sums instances
                want = want.sum(0)
            err = rel_err(got[j], want)
            assert got[j].shape == want.shape and err <= 1e-5, f"{name}: {n} error {err:.3g}"


def test_remat_and_jit(platform, rng):
    # jax.checkpoint recomputes the forward in the backward pass: the same gradients, bit for bit
    # (deterministic mode, so that no atomic sum differs between the runs).
    q, k, v = platform.put(*_loss_inputs(rng, jnp.bfloat16))

    def layer(q, k, v):
        o = jax_flash.flash_attention(
            q, k, v, causal=True, implementation=platform.name, deterministic=True
        )
        return jnp.sum(o.astype(jnp.float32) ** 2)

    plain = jax.jit(jax.grad(layer, (0, 1, 2)))(q, k, v)
    remat = jax.jit(jax.grad(jax.checkpoint(layer), (0, 1, 2)))(q, k, v)
    eager = jax.grad(layer, (0, 1, 2))(q, k, v)
    for a, b, c in zip(plain, remat, eager, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_bit_identical(platform, rng, deterministic):
    # GQA over packed sequences in bfloat16: two calls give the same bits with
    # deterministic=True, and on the CPU in both modes (on CUDA the default accumulates dq with
    # atomics).
    cu = jnp.array([0, 150, 151, 300], jnp.int32)
    q = randn(rng, (300, 8, 64), jnp.bfloat16)
    k = randn(rng, (300, 2, 64), jnp.bfloat16)
    v = randn(rng, (300, 2, 64), jnp.bfloat16)
    do = randn(rng, (300, 8, 64), jnp.bfloat16)

    def f(q, k, v, do, cu):
        fn = functools.partial(
            jax_flash.flash_attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
            implementation=platform.name, deterministic=deterministic,
        )  # fmt: skip
        return _vjp(fn, (q, k, v), do)

    args = platform.put(q, k, v, do, cu)
    first = jax.jit(f)(*args)
    second = jax.jit(f)(*args)
    bit_identical = deterministic or platform.name == "cpu"
    for n, a, b in zip(NAMES, first, second, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a.astype(np.float32))), n
        if bit_identical:
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=n)
        else:  # float32 atomics: the order of dq's sums may differ
            assert rel_err(a, b) <= tolerance(jnp.bfloat16, 0.0), n
    if deterministic:  # and they are right
        ref_fn = functools.partial(reference.attention_varlen, causal=True)
        ref = jax.jit(lambda q, k, v, do: _vjp(lambda *a: ref_fn(*a, cu, cu), (q, k, v), do))(
            *_f32(q, k, v, do)
        )
        for n, a, r in zip(NAMES, first, ref, strict=True):
            assert rel_err(a, r) <= tolerance(jnp.bfloat16, 0.0), n


def test_backward_reference_lowering_matches_kernel(rng):
    # The lowering for platforms without a backward kernel (jax.vjp of the packed reference)
    # gives the kernel's results.
    from jax_flash.primitives import flash_attention_bwd as bwd

    q, k, v = _loss_inputs(rng)
    o, lse = jax_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    do = randn(rng, o.shape, jnp.float32)
    dlse = randn(rng, lse.shape, jnp.float32)
    B, Sq, Hq, D = q.shape
    Skv = k.shape[1]
    config = bwd.FlashConfig(
        softmax_scale=D**-0.5, softcap=0.0, window_left=-1, window_right=0, max_seqlen_q=Sq,
        fill_uncovered=False, implementation=None, dense=True,
    )  # fmt: skip
    qs = jnp.arange(B, dtype=jnp.int32) * Sq
    ks = jnp.arange(B, dtype=jnp.int32) * Skv
    args = (
        q.reshape(B * Sq, Hq, D), k.reshape(B * Skv, 2, D), v.reshape(B * Skv, 2, D),
        o.reshape(B * Sq, Hq, D), lse.transpose(1, 0, 2).reshape(Hq, B * Sq),
        do.reshape(B * Sq, Hq, D), dlse.transpose(1, 0, 2).reshape(Hq, B * Sq),
        qs, qs + Sq, ks, ks + Skv,
    )  # fmt: skip
    kernel = bwd.flash_attention_bwd_p.bind(*args, config=config)
    fallback = jax.jit(functools.partial(bwd._reference, config=config))(*args)
    for n, a, b in zip(NAMES, kernel, fallback, strict=True):
        assert rel_err(a, b) <= 1e-5, n


def test_deterministic_must_be_a_bool():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        jax_flash.flash_attention(q, q, q, deterministic=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cu = jnp.array([0, 4], jnp.int32)
        jax_flash.flash_attention_varlen(q[0], q[0], q[0], cu, cu, deterministic="yes")
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,))
    with pytest.raises(TypeError, match="context_parallel_attention: deterministic must be"):
        jax_flash.context_parallel_attention(q, q, q, mesh=mesh, seq_axis="seq", deterministic=0)


def test_bwd_launch_is_checked_and_reaches_the_call():
    # The backward's launch options (which CUDA kernel on Hopper): a FlashBwdLaunch or an
    # error naming the argument; the config carries it to the FFI call as hopper_kernel (the CPU
    # kernel ignores it: its gradients are the same under either choice).
    from jax_flash.primitives import flash_attention_bwd as bwd
    from jax_flash.primitives.flash_attention import FlashBwdLaunch

    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match="_bwd_launch must be a FlashBwdLaunch"):
        jax_flash.flash_attention(q, q, q, _bwd_launch="mma")
    with pytest.raises(ValueError, match="hopper_kernel must be one of"):
        FlashBwdLaunch("wgmma")
    cfg = dict(
        softmax_scale=1.0, softcap=0.0, window_left=-1, window_right=-1, max_seqlen_q=4,
        fill_uncovered=False, implementation=None,
    )  # fmt: skip
    for launch, attr in (
        (FlashBwdLaunch("hopper"), 1),
        (FlashBwdLaunch("mma"), 0),
        (FlashBwdLaunch("hopper", strict=True), 2),
        (FlashBwdLaunch("mma", strict=True), 0),
    ):
        config = bwd.FlashConfig(**cfg, _bwd_launch=launch)
        assert bwd._ffi_attrs(config)["hopper_kernel"] == attr


# --- 4 devices ---------------------------------------------------------------------------------

N = 4
MULTI = jax.device_count() >= N
multi = pytest.mark.skipif(not MULTI, reason=f"needs {N} devices (run in the subprocess)")
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)")


@pytest.mark.skipif(MULTI, reason="the checks run directly here")
def test_on_four_host_devices():
    run_on_host_devices(__file__, N, "multi_device")


def _multi_inputs(rng, B=4, S=64):
    q = randn(rng, (B, S, 4, 16), jnp.float32)
    k = randn(rng, (B, S, 2, 16), jnp.float32)
    v = randn(rng, (B, S, 2, 16), jnp.float32)
    do = randn(rng, q.shape, jnp.float32)
    dlse = randn(rng, (B, 4, S), jnp.float32)
    return q, k, v, do, dlse


def _loss(attention, do, dlse):
    def f(q, k, v):
        o, lse = attention(q, k, v)
        return jnp.sum(o * do) + jnp.sum(lse * dlse)

    return f


@multi
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_multi_device_sharded_mesh(rng, axis_type):
    # The backward primitive partitions like the forward: on a mesh splitting batch and heads
    # each device differentiates its own sequences and KV-head groups, with no collective,
    # bit-identical to one device; the gradients keep the inputs' sharding.
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    q, k, v, do, dlse = _multi_inputs(rng)
    attn = functools.partial(
        jax_flash.flash_attention, causal=True, return_lse=True, deterministic=True
    )
    f = jax.jit(jax.grad(_loss(attn, do, dlse), (0, 1, 2)))
    one = f(*(jax.device_put(x, jax.devices()[0]) for x in (q, k, v)))
    spec = P("data", None, "model")
    sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        got = f(*sharded)
        compiled = f.lower(*sharded).compile().as_text()
    for n, a, b in zip(NAMES, got, one, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=n)
        assert tuple(a.sharding.spec)[:3] == tuple(spec), (n, a.sharding)
    assert not COLLECTIVE.findall(compiled)


@multi
def test_multi_device_shard_map(rng):
    # Inside shard_map each device binds both primitives on its shard.
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    q, k, v, do, dlse = _multi_inputs(rng)
    attn = functools.partial(jax_flash.flash_attention, causal=True, return_lse=True)
    mapped = jax.shard_map(
        attn, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=(P("data"), P("data"))
    )
    got = jax.jit(jax.grad(_loss(mapped, do, dlse), (0, 1, 2)))(q, k, v)
    ref_attn = functools.partial(reference.attention, causal=True, return_lse=True)
    ref = jax.jit(jax.grad(_loss(ref_attn, do, dlse), (0, 1, 2)))(q, k, v)
    _check(got, ref, None, jnp.float32)


@multi
@pytest.mark.parametrize(
    "strategy,causal,window,deterministic",
    [("ring", True, None, False), ("allgather", False, (9, 3), True)],
)
def test_multi_device_context_parallel(rng, strategy, causal, window, deterministic):
    # Gradients flow through context parallelism: the lse merge, ppermute / all_gather and the
    # per-device switch all differentiate, with the kernels' VJP (lse cotangent included).
    mesh = jax.make_mesh((N,), ("seq",), axis_types=(AxisType.Auto,))
    q, k, v, do, dlse = _multi_inputs(rng, B=2)
    opts = dict(causal=causal, sliding_window=window, return_lse=True)
    attn = functools.partial(
        jax_flash.context_parallel_attention, mesh=mesh, seq_axis="seq", strategy=strategy,
        deterministic=deterministic, **opts,
    )  # fmt: skip
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    got = jax.jit(jax.grad(_loss(attn, do, dlse), (0, 1, 2)))(*sharded)
    ref_attn = functools.partial(reference.attention, **opts)
    ref = jax.jit(jax.grad(_loss(ref_attn, do, dlse), (0, 1, 2)))(q, k, v)
    _check(got, ref, None, jnp.float32)
