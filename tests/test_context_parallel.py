"""Context parallelism (jax_flash.parallel) on 4 devices, against jax_flash.reference and the
single-device flash_attention.

A CPU-only JAX has 4 devices only when XLA_FLAGS asks for them before JAX starts. In a default
run (one device) `test_on_four_host_devices` runs this file again in a subprocess with
--xla_force_host_platform_device_count=4 on the CPU platform and fails with its output if any
check fails or is skipped; where 4 devices are visible (that subprocess, or a host with 4 GPUs)
the checks run directly. The planner, merge and layout checks need no devices and always run.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import parallel, reference
from jax_flash.parallel import _tiles, context

from _util import collective_operands, randn, rel_err, run_on_host_devices, tolerance

N = 4
MULTI = len(jax.devices()) >= N
multi = pytest.mark.skipif(not MULTI, reason=f"needs {N} devices (run in the subprocess)")


@pytest.mark.skipif(MULTI, reason="the checks run directly here")
def test_on_four_host_devices():
    run_on_host_devices(__file__, N, "not test_on_four_host_devices")


# --- no devices needed ---------------------------------------------------------------------


def _kernel_pairs(t: _tiles.Tile):
    """The (q row, k row) pairs of the local buffers that tile t's kernel call attends."""
    sq, sk = t.q1 - t.q0, t.k1 - t.k0
    r, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    d = j - r - (sk - sq)
    seen = np.ones_like(d, bool)
    if t.left >= 0:
        seen &= d >= -t.left
    if t.right >= 0:
        seen &= d <= t.right
    return {(t.q0 + a, t.k0 + b) for a, b in zip(*np.nonzero(seen), strict=True)}


def _true_pairs(q_segments, k_segments, left, right):
    out = set()
    for qs, ks in itertools.product(q_segments, k_segments):
        for r, j in itertools.product(range(qs.length), range(ks.length)):
            d = (ks.pos + j) - (qs.pos + r)
            if (left < 0 or d >= -left) and (right < 0 or d <= right):
                out.add((qs.start + r, ks.start + j))
    return out


def test_plan_covers_the_mask_exactly():
    # Every (device, ring step) and the all-gathered form: the tiles' kernel masks cover each
    # visible pair once and nothing else; odd chunk lengths, windows narrower and wider than a
    # block, both layouts.
    for n, sl in ((1, 6), (2, 2), (3, 10), (4, 6)):
        for (left, right), layout in itertools.product(
            [(-1, -1), (-1, 0), (0, 0), (3, 0), (1, 4), (-1, 7), (sl + 1, -1)],
            ["natural", "zigzag"],
        ):
            for d in range(n):
                q_seg = _tiles.segments(layout, d, n, sl)
                k_blocks = [_tiles.segments(layout, s, n, sl) for s in range(n)]
                for k_seg in [*k_blocks, (_tiles.Segment(0, 0, n * sl),)]:
                    tiles = _tiles.plan(q_seg, k_seg, left, right)
                    pairs = [_kernel_pairs(t) for t in tiles]
                    union = set().union(*pairs)
                    assert sum(map(len, pairs)) == len(union), f"overlapping tiles {tiles}"
                    assert union == _true_pairs(q_seg, k_seg, left, right), (n, sl, layout, d)


def test_plan_is_balanced_and_skips_hidden_blocks():
    # Causal zigzag: one call per device and ring step, every step the same work on every
    # device (the balance); natural: the blocks right of the diagonal make no call.
    n, sl = 4, 8
    for s in range(n):
        plans = [
            _tiles.plan(
                _tiles.segments("zigzag", d, n, sl),
                _tiles.segments("zigzag", (d - s) % n, n, sl),
                -1,
                0,
            )
            for d in range(n)
        ]
        assert all(len(p) == 1 for p in plans)
        work = {sum((t.q1 - t.q0) * (t.k1 - t.k0) for t in p) for p in plans}
        assert len(work) == 1
    natural = context._ring_plans("natural", "natural", n, sl, (-1, 0))
    assert [sum(bool(p) for p in step) for step in natural] == [4, 3, 2, 1]
    # A window of 3 keys: only the own block and the left neighbour's; the ring stops there.
    assert len(context._ring_plans("natural", "natural", n, sl, (3, 0))) == 2


def _np_attention(q, k, v):
    """float64 softmax attention and its lse, [B, S, H, D] layouts, no mask."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = np.log(p.sum(-1)) + m[..., 0]
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v), lse


def test_merge_is_the_softmax_over_the_union():
    rng = np.random.default_rng()
    B, S, H, Dv, Skv = 2, 9, 3, 5, 12
    q, k = rng.standard_normal((B, S, H, 4)), rng.standard_normal((B, Skv, H, 4))
    v = rng.standard_normal((B, Skv, H, Dv))
    whole = _np_attention(q, k, v)
    acc = (jnp.zeros((B, S, H, Dv)), jnp.full((B, H, S), -jnp.inf))
    for lo, hi in ((0, 5), (5, Skv)):
        part = _np_attention(q, k[:, lo:hi], v[:, lo:hi])
        acc = context._merge(acc, *(jnp.asarray(x, jnp.float32) for x in part))
    np.testing.assert_allclose(acc[0], whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc[1], whole[1], rtol=1e-6)
    # Rows no partial has seen: 0 and -inf, never NaN.
    empty = (jnp.zeros((1, 2, 1, 3)), jnp.full((1, 1, 2), -jnp.inf))
    o, lse = context._merge(empty, *empty)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_zigzag_order_and_inverse():
    assert parallel.to_zigzag(jnp.arange(12), 3, axis=0).tolist() == [
        0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7,
    ]  # fmt: skip
    x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    for n in (1, 2, 3, 4):
        z = parallel.to_zigzag(x, n)
        assert not np.array_equal(z, x) or n == 1
        np.testing.assert_array_equal(parallel.from_zigzag(z, n), x)
    with pytest.raises(ValueError, match="not divisible by 10"):
        parallel.to_zigzag(x, 5)


def test_choose_strategy_rule():
    big = context.ALLGATHER_MAX_BYTES + 1
    assert context.choose_strategy(n=4, gathered_kv_bytes=1 << 20, ring_steps=4) == "allgather"
    assert context.choose_strategy(n=4, gathered_kv_bytes=big, ring_steps=4) == "ring"
    assert context.choose_strategy(n=4, gathered_kv_bytes=1 << 20, ring_steps=2) == "ring"


def test_argument_errors():
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,))
    q = jnp.zeros((1, 8, 4, 16))
    cp = functools.partial(jax_flash.context_parallel_attention, mesh=mesh, seq_axis="seq")
    with pytest.raises(ValueError, match="not divisible by 2"):
        cp(q[:, :7], q[:, :7], q[:, :7], layout="zigzag")
    with pytest.raises(ValueError, match="strategy must be one of"):
        cp(q, q, q, strategy="tree")
    with pytest.raises(ValueError, match="seq_axis 'sequence' is not an axis"):
        cp(q, q, q, seq_axis="sequence")
    with pytest.raises(ValueError, match="self-attention"):
        cp(q, q[:, :4], q[:, :4])
    with pytest.raises(ValueError, match="causal=True allows no keys right"):
        cp(q, q, q, causal=True, sliding_window=(2, 2))


# --- on 4 devices --------------------------------------------------------------------------


def _mesh(shape=(N,), names=("seq",), kind=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _inputs(rng, B, S, Hq, Hkv, D, dtype, Dv=None):
    Dv = D if Dv is None else Dv
    return (
        randn(rng, (B, S, Hq, D), dtype),
        randn(rng, (B, S, Hkv, D), dtype),
        randn(rng, (B, S, Hkv, Dv), dtype),
    )


def _assert_matches(o, lse, q, k, v, **opts):
    """o, lse against the float32 reference (the dtype-aware tolerance) and, in float32, against
    the single-device kernel on the whole sequence."""
    dtype = q.dtype
    o, lse = np.asarray(o.astype(jnp.float32)), np.asarray(lse)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_o, ref_lse = jax.jit(functools.partial(reference.attention, return_lse=True, **opts))(*f32)
    same_err = 0.0  # float32: the reference itself
    if dtype != jnp.float32:
        same = functools.partial(reference.attention, compute_dtype=dtype, **opts)
        same_err = rel_err(jax.jit(same)(q, k, v), ref_o)
    tol = tolerance(dtype, same_err)
    err = rel_err(o, ref_o)
    assert err <= tol, f"relative error {err:.3g} > tolerance {tol:.3g}"
    assert not np.any(np.isnan(lse))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    atol = tolerance(dtype, 0.0)
    np.testing.assert_allclose(lse, ref_lse, rtol=atol, atol=atol)
    if dtype == jnp.float32:
        one = jax.jit(functools.partial(jax_flash.flash_attention, return_lse=True, **opts))
        one_o, one_lse = one(q, k, v)
        assert rel_err(o, one_o) <= tolerance(dtype, 0.0)
        np.testing.assert_allclose(lse, one_lse, rtol=atol, atol=atol)


def _assert_sharded(x, mesh, spec):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), x.sharding


def _cp(mesh, q, k, v, **kw):
    fn = functools.partial(
        jax_flash.context_parallel_attention, mesh=mesh, seq_axis="seq", return_lse=True, **kw
    )
    return jax.jit(fn)(q, k, v)


@multi
@pytest.mark.parametrize("layout", ["natural", "zigzag"])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("causal", [True, False])
def test_against_one_device(rng, causal, strategy, layout):
    # S = 56: blocks of 14, zigzag chunks of 7; GQA 3, Dv != D.
    q, k, v = _inputs(rng, 2, 56, 6, 2, 64, jnp.float32, Dv=40)
    o, lse = _cp(_mesh(), q, k, v, causal=causal, strategy=strategy, layout=layout)
    assert o.shape == (2, 56, 6, 40) and o.dtype == jnp.float32 and lse.shape == (2, 6, 56)
    _assert_sharded(o, _mesh(), P(None, "seq"))
    _assert_matches(o, lse, q, k, v, causal=causal)


@multi
@pytest.mark.parametrize(
    "window,causal,layout,strategy",
    [
        ((9, None), True, "natural", "ring"),  # the ring stops after the left neighbour
        ((9, None), True, "zigzag", "allgather"),
        ((20, 5), False, "zigzag", "ring"),  # plans differ per device: a switch
        ((None, 3), False, "natural", "allgather"),
    ],
)
def test_sliding_window(rng, window, causal, layout, strategy):
    # S = 52 (natural: blocks of 13) or 56 (zigzag: chunks of 7).
    S = 56 if layout == "zigzag" else 52
    q, k, v = _inputs(rng, 1, S, 4, 1, 64, jnp.float32)
    opts = dict(causal=causal, sliding_window=window)
    o, lse = _cp(_mesh(), q, k, v, strategy=strategy, layout=layout, **opts)
    _assert_matches(o, lse, q, k, v, **opts)


@multi
def test_bfloat16_soft_cap_and_scale(rng):
    q, k, v = _inputs(rng, 1, 72, 5, 5, 128, jnp.bfloat16)
    opts = dict(causal=True, logits_soft_cap=5.0, softmax_scale=0.3)
    o, lse = _cp(_mesh(), q, k, v, strategy="ring", **opts)
    assert o.dtype == jnp.bfloat16
    _assert_matches(o, lse, q, k, v, **opts)


@multi
@pytest.mark.parametrize("other", ["batch", "heads"])
def test_batch_or_heads_on_a_second_axis(rng, other):
    mesh = _mesh((2, 2), ("seq", other))
    q, k, v = _inputs(rng, 2, 36, 6, 2, 64, jnp.float32)
    axes = {"batch_axis": "batch"} if other == "batch" else {"head_axis": "heads"}
    o, lse = _cp(mesh, q, k, v, causal=True, **axes)
    spec = P("batch", "seq", None, None) if other == "batch" else P(None, "seq", "heads", None)
    _assert_sharded(o, mesh, spec)
    _assert_matches(o, lse, q, k, v, causal=True)
    with pytest.raises(ValueError, match="KV heads \\(1\\) must be divisible"):
        _cp(mesh, q, k[:, :, :1], v[:, :, :1], head_axis=other)


@multi
def test_explicit_mesh(rng):
    mesh = _mesh(kind=AxisType.Explicit)
    q, k, v = _inputs(rng, 1, 40, 4, 2, 64, jnp.float32)
    o, lse = jax_flash.context_parallel_attention(
        q, k, v, mesh=mesh, seq_axis="seq", causal=True, return_lse=True
    )
    _assert_sharded(o, mesh, P(None, "seq"))
    _assert_matches(o, lse, q, k, v, causal=True)


@multi
def test_zigzag_order_kept_by_the_caller(rng):
    # A model holding its tokens in zigzag order: no reshuffle, output in zigzag order (the mesh
    # entry with the all-gather, the per-device function in the caller's shard_map with the ring).
    mesh = _mesh()
    q, k, v = _inputs(rng, 1, 64, 4, 2, 64, jnp.float32)
    z = [parallel.to_zigzag(x, N) for x in (q, k, v)]
    o, lse = _cp(mesh, *z, causal=True, strategy="allgather", layout="zigzag", reorder=False)
    o, lse = parallel.from_zigzag(o, N), parallel.from_zigzag(lse, N, axis=2)
    _assert_matches(o, lse, q, k, v, causal=True)

    def per_device(q, k, v):
        return parallel.ring_attention(
            q, k, v, axis_name="seq", causal=True, layout="zigzag", strategy="ring",
            return_lse=True,
        )  # fmt: skip

    spec = P(None, "seq")
    fn = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=(spec, P(None, None, "seq")))
    o2, lse2 = jax.jit(fn)(*z)
    _assert_matches(
        parallel.from_zigzag(o2, N), parallel.from_zigzag(lse2, N, axis=2), q, k, v, causal=True
    )


@multi
def test_shard_zigzag_equals_the_global_permutation():
    mesh = _mesh()
    x = jnp.arange(2 * 40 * 3, dtype=jnp.float32).reshape(2, 40, 3)
    spec = P(None, "seq")
    shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    z = jax.jit(shard(lambda x: parallel.shard_to_zigzag(x, "seq", N)))(x)
    np.testing.assert_array_equal(z, parallel.to_zigzag(x, N))
    back = jax.jit(shard(lambda x: parallel.shard_from_zigzag(x, "seq", N)))(z)
    np.testing.assert_array_equal(back, x)


@multi
def test_hook_for_sequence_sharded_flash_attention(rng):
    mesh = _mesh()
    q, k, v = _inputs(rng, 2, 44, 6, 3, 64, jnp.float32)
    opts = dict(causal=True, sliding_window=(15, 0))

    def per_shard(q, k, v):
        return parallel.context_parallel_shard(q, k, v, axis_name="seq", axis_size=N, **opts)

    spec = P(None, "seq")
    fn = jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=(spec, P(None, None, "seq")))
    o, lse = jax.jit(fn)(q, k, v)
    _assert_matches(o, lse, q, k, v, **opts)


def _collectives(mesh, **kw):
    """The compiled program's collectives: op name -> the shapes each sends, q [1, 64, 4, 32] and
    k/v [1, 64, 2, 32] sharded on the sequence."""
    sharding = NamedSharding(mesh, P(None, "seq"))
    q = jax.device_put(jnp.zeros((1, 64, 4, 32), jnp.float32), sharding)
    kv = jax.device_put(jnp.zeros((1, 64, 2, 32), jnp.float32), sharding)
    fn = functools.partial(jax_flash.context_parallel_attention, mesh=mesh, seq_axis="seq", **kw)
    hlo = jax.jit(fn).lower(q, kv, kv).compile().as_text()
    # Shapes without their unit dims: a GPU program gathers k [1, 16, 2, 32] as [16, 2, 32].
    return {
        op: [
            tuple(d for d in shape if d != 1)
            for dtype, shape in collective_operands(hlo, op)
            if dtype == "f32"
        ]
        for op in ("all-gather", "collective-permute")
    }


@multi
def test_collectives_in_the_compiled_program():
    mesh = _mesh()
    # Ring, natural: k and v blocks sent N - 1 times each; nothing gathered.
    ring = _collectives(mesh, causal=True, strategy="ring", layout="natural")
    assert ring == {"all-gather": [], "collective-permute": [(16, 2, 32)] * 2 * (N - 1)}
    # A window of 3 keys: one step (k and v once).
    window = _collectives(mesh, causal=True, sliding_window=(3, 0), strategy="ring")
    assert window == {"all-gather": [], "collective-permute": [(16, 2, 32)] * 2}
    # All-gather, zigzag: k and v gathered in natural order (each device's 16 rows; q never);
    # q's half blocks permuted in and o's out.
    gather = _collectives(mesh, causal=True, strategy="allgather", layout="zigzag")
    assert gather == {"all-gather": [(16, 2, 32)] * 2, "collective-permute": [(8, 4, 32)] * 4}
