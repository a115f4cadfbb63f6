"""Dense flash_attention with its sequence axis sharded under jax.jit (context parallelism in the
partitioned lowering, primitives/sequence_sharding.py): results and gradients equal the
one-device run and the reference, o keeps q's sharding, and the compiled program gathers no
q-sized array (q, o, lse, do, dq): the only all-gathers are of K/V. A causal mask is balanced
over the devices (zigzag half-blocks): the only q-sized transfers are the half-blocks' exchange,
and each device's count of visible tiles is the same.

Like tests/test_sharding.py, the checks need 4 devices: with fewer, `test_on_host_devices` runs
this file again in a subprocess with 4 CPU host devices.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import reference
from jax_flash.primitives.flash_attention import FlashConfig
from jax_flash.primitives.sequence_sharding import device_work, row_layout

from _util import collective_operands, randn, rel_err, run_on_host_devices

DEVICES = 4
_ENOUGH = jax.device_count() >= DEVICES
needs_devices = pytest.mark.skipif(not _ENOUGH, reason=f"needs {DEVICES} devices")
HQ, HKV, D, DV = 6, 2, 16, 8  # HQ appears in no other dimension: a q-sized gather shows by it
TOL = 2e-5  # float32 inputs: one device's kernel against the sharded one and the reference


@pytest.mark.skipif(_ENOUGH, reason="the checks run in place")
def test_on_host_devices():
    run_on_host_devices(__file__, DEVICES, "not test_on_host_devices")


def _mesh():
    devices = np.array(jax.devices()[:DEVICES]).reshape(2, 2)
    return jax.sharding.Mesh(devices, ("data", "model"))


_GATHER = re.compile(r"=\s*(.*?)\s(all-gather(?:-start)?)\(")


def _gathered_shapes(compiled_text):
    """The result shapes of every all-gather in the compiled program."""
    shapes = []
    for m in _GATHER.finditer(compiled_text):
        shapes += [
            tuple(int(x) for x in s.split(",") if x) for s in re.findall(r"\[([\d,]*)\]", m[1])
        ]
    return shapes


def _permuted_shapes(compiled_text):
    """The shapes every collective-permute in the compiled program sends."""
    return [shape for _, shape in collective_operands(compiled_text, "collective-permute")]


def _q_shards(spec):
    """How many ways a q spec splits the sequence rows (its second entry)."""
    entry = (tuple(spec) + (None, None))[1]
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return 2 ** len(names)  # every axis of _mesh() has size 2


def _put(args, specs, mesh):
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]


def _one_device(fn, args):
    return jax.jit(fn)(*[jax.device_put(a, jax.devices()[0]) for a in args])


def _close(got, want):
    # lse is -inf on rows that see no key: those must match, the rest be close.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        seen = np.isfinite(w)
        assert np.array_equal(np.isfinite(g), seen)
        assert rel_err(g[seen], w[seen]) <= TOL, rel_err(g[seen], w[seen])


# (B, Sq, Skv, q spec, k/v spec, lens, options): q/k/v sequence-sharded 4 ways (one sequence),
# batch x sequence (one sequence per device pair), q alone, k/v alone, Sq != Skv, valid lengths.
CASES = {
    "seq4-causal": (1, 16, 16, P(None, ("data", "model")), P(None, ("data", "model")), False,
                    dict(causal=True)),
    "batch-seq-full-lens": (2, 12, 20, P("data", "model"), P("data", "model"), True, {}),
    "batch-seq-causal-lens": (2, 12, 20, P("data", "model"), P("data", "model"), True,
                              dict(causal=True)),
    "q-only-causal-lens": (1, 8, 20, P(None, ("data", "model")), P(), True, dict(causal=True)),
    "window-left": (2, 16, 16, P("data", "model"), P("data", "model"), True,
                    dict(sliding_window=(5, 0))),
    # q and k/v rows split over different axes: the per-device call gathers K/V itself and
    # sums dK/dV over q's axis before keeping its own key rows.
    "q-model-kv-data": (1, 12, 16, P(None, "model"), P(None, "data"), True, dict(causal=True)),
    "kv-only": (1, 12, 16, P(), P(None, ("data", "model")), False, {}),
    # Skv < Sq: the first 8 rows see no key (o = 0, lse = -inf), some half-blocks none at all.
    "seq4-causal-short-kv": (1, 16, 8, P(None, ("data", "model")), P(None, ("data", "model")),
                             False, dict(causal=True)),
    # 3 rows per device cannot be halved: the natural layout (unbalanced, exact).
    "seq4-causal-odd": (1, 12, 12, P(None, ("data", "model")), P(None, ("data", "model")), True,
                        dict(causal=True)),
}  # fmt: skip


def _inputs(rng, B, Sq, Skv, lens):
    q = randn(rng, (B, Sq, HQ, D), jnp.float32)
    k = randn(rng, (B, Skv, HKV, D), jnp.float32)
    v = randn(rng, (B, Skv, HKV, DV), jnp.float32)
    if not lens:
        return (q, k, v), None
    ql = jnp.asarray(rng.integers(1, Sq + 1, B), jnp.int32).at[0].set(Sq - 3)
    kl = jnp.asarray(rng.integers(1, Skv + 1, B), jnp.int32)
    return (q, k, v), (ql, kl)


def _fn(lens, opts):
    def fn(q, k, v, *ls):
        kw = dict(zip(("q_seqlens", "kv_seqlens"), ls, strict=False))
        return jax_flash.flash_attention(q, k, v, return_lse=True, **kw, **opts)

    return fn


@needs_devices
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients(rng, case):
    B, Sq, Skv, q_spec, kv_spec, lens, opts = CASES[case]
    (q, k, v), ls = _inputs(rng, B, Sq, Skv, lens)
    args = (q, k, v) + (ls or ())
    specs = [q_spec, kv_spec, kv_spec] + ([P(q_spec[0])] * 2 if ls else [])
    mesh = _mesh()
    fn = _fn(lens, opts)
    sharded = _put(args, specs, mesh)

    # Forward: the one-device result and the reference; o and lse stay sharded like q.
    f = jax.jit(fn)
    o, lse = f(*sharded)
    _close((o, lse), _one_device(fn, args))
    kw = dict(zip(("q_seqlens", "kv_seqlens"), ls or (), strict=False))
    _close((o, lse), reference.attention(q, k, v, return_lse=True, **kw, **opts))
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), 4)
    q_b, q_s = (tuple(q_spec) + (None, None))[:2]
    lse_spec = P(q_b, None, q_s)
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, lse_spec), 3)
    hlo = f.lower(*sharded).compile().as_text()
    gathered = _gathered_shapes(hlo)
    assert all(HQ not in s for s in gathered), gathered  # K/V (HKV heads) only
    if kv_spec == P():
        assert gathered == []
    # Causal with an even number of rows per device: balanced, and the only q-sized transfers
    # are the half-blocks (c rows) moving between devices, q's in, o's and lse's back.
    n = _q_shards(q_spec)
    balanced = opts == dict(causal=True) and n > 1 and (Sq // n) % 2 == 0
    c = Sq // n // 2
    halves = {(c, HQ, D), (c, HQ, DV), (HQ, c)}
    permuted = _permuted_shapes(hlo)
    assert (len(permuted) == 6 and set(permuted) == halves) if balanced else permuted == [], (
        permuted
    )

    # Gradients of q, k and v (through o and lse), against one device and the reference.
    w_o = randn(rng, (B, Sq, HQ, DV), jnp.float32)
    w_lse = randn(rng, (B, HQ, Sq), jnp.float32)

    def loss(q, k, v, *ls, attn=fn):
        o, lse = attn(q, k, v, *ls)
        return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    dq, dk, dv = grad(*sharded)
    _close((dq, dk, dv), _one_device(jax.grad(loss, argnums=(0, 1, 2)), args))

    def ref_attn(q, k, v, *ls):
        kw = dict(zip(("q_seqlens", "kv_seqlens"), ls, strict=False))
        return reference.attention(q, k, v, return_lse=True, **kw, **opts)

    ref_grads = jax.grad(lambda *a: loss(*a, attn=ref_attn), argnums=(0, 1, 2))(*args)
    _close((dq, dk, dv), ref_grads)
    assert dq.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), 4)
    hlo = grad.lower(*sharded).compile().as_text()
    gathered = _gathered_shapes(hlo)
    assert all(HQ not in s for s in gathered), gathered
    # The backward's exchange: q, o, do, lse and dlse in, dq back (beside the forward's 6).
    permuted = _permuted_shapes(hlo)
    assert (len(permuted) == 18 and set(permuted) <= halves) if balanced else permuted == [], (
        permuted
    )


@needs_devices
def test_window_right_of_diagonal_is_gathered(rng):
    # A band right of the diagonal needs keys a shard's alignment would drop: the sequence is
    # gathered first (sequence_sharded_prefill), still exact.
    (q, k, v), _ = _inputs(rng, 1, 16, 16, False)
    fn = _fn(False, dict(sliding_window=(3, 2)))
    spec = P(None, ("data", "model"))
    f = jax.jit(fn)
    sharded = _put((q, k, v), [spec] * 3, _mesh())
    _close(f(*sharded), _one_device(fn, (q, k, v)))
    assert any(HQ in s for s in _gathered_shapes(f.lower(*sharded).compile().as_text()))


@needs_devices
@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_other_partitioner_and_explicit_mode(rng, mode):
    # The GSPMD partitioner takes the same rule; explicit sharding mode types o (and dq) with
    # q's sharding and takes k/v split like q without a reshard.
    B, Sq, Skv, q_spec, kv_spec, _, opts = CASES["batch-seq-causal-lens"]
    (q, k, v), ls = _inputs(rng, B, Sq, Skv, True)
    args, specs = (q, k, v, *ls), [q_spec, kv_spec, kv_spec, P("data"), P("data")]
    fn = _fn(True, opts)
    grad = jax.grad(lambda *a: jnp.sum(fn(*a)[0] ** 2), argnums=(0, 1, 2))
    single = (_one_device(fn, args), _one_device(grad, args))
    if mode == "gspmd":
        shardy = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", False)
        try:
            sharded = _put(args, specs, _mesh())
            out = (jax.jit(fn)(*sharded), jax.jit(grad)(*sharded))
        finally:
            jax.config.update("jax_use_shardy_partitioner", shardy)
    else:
        devices = np.array(jax.devices()[:DEVICES]).reshape(2, 2)
        mesh = jax.sharding.Mesh(devices, ("data", "model"), (AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh):
            out = (jax.jit(fn)(*_put(args, specs, mesh)), jax.jit(grad)(*_put(args, specs, mesh)))
            assert jax.typeof(out[0][0]).sharding.spec == P("data", "model", None, None)
    _close(out, single)
    like_q = NamedSharding(_mesh(), q_spec)
    assert out[0][0].sharding.is_equivalent_to(like_q, 4)
    assert out[1][0].sharding.is_equivalent_to(like_q, 4)


@needs_devices
def test_natural_layout_is_unbalanced_and_exact(rng):
    # _sequence_layout="natural" (what benchmarks time the balance against) keeps each device on
    # its own rows: no exchange, the same results.
    (q, k, v), _ = _inputs(rng, 1, 16, 16, False)
    spec = P(None, ("data", "model"))
    sharded = _put((q, k, v), [spec] * 3, _mesh())
    outs = []
    for layout in ("auto", "natural"):
        f = jax.jit(lambda q, k, v, layout=layout: jax_flash.flash_attention(
            q, k, v, causal=True, return_lse=True, _sequence_layout=layout))  # fmt: skip
        outs.append(f(*sharded))
        assert bool(_permuted_shapes(f.lower(*sharded).compile().as_text())) == (layout == "auto")
    _close(outs[0], outs[1])
    with pytest.raises(ValueError, match="_sequence_layout must be one of"):
        jax_flash.flash_attention(q, k, v, _sequence_layout="zigzag")


def _config(sq, **window):
    window = dict(window_left=-1, window_right=0) | window
    return FlashConfig(1.0, 0.0, max_seqlen_q=sq, fill_uncovered=False, implementation=None,
                       dense=True, **window)  # fmt: skip


@pytest.mark.parametrize("n,sq,skv", [(4, 131072, 131072), (2, 8192, 12288), (8, 32768, 32768)])
def test_causal_work_is_balanced(n, sq, skv):
    # Each device's visible (query block, key block) tiles, from the layout and the per-call
    # extents the lowering uses: equal on every device, against the natural layout's last
    # device doing (2n-1)/n^2 of the work (Sq = Skv), the same tiles in all.
    config = _config(sq)
    assert row_layout(config, n, sq // n) == "zigzag"
    work = device_work(config, n, sq, skv)
    natural = device_work(dataclasses.replace(config, _sequence_layout="natural"), n, sq, skv)
    assert sum(work) == sum(natural)
    assert max(work) == min(work), work
    assert natural == sorted(natural) and natural[0] < natural[-1]
    if sq == skv:
        assert natural[-1] / sum(natural) == pytest.approx((2 * n - 1) / n**2, rel=1e-2)


def test_other_masks_keep_the_natural_layout():
    # Nothing to balance (no mask, a window) or rows that cannot be halved: the natural layout,
    # whose work is already even where there is no causal triangle.
    assert row_layout(_config(4096, window_right=-1), 4, 1024) == "natural"
    assert row_layout(_config(4096, window_left=256), 4, 1024) == "natural"
    assert row_layout(_config(4092), 4, 1023) == "natural"
    assert row_layout(_config(4096), 1, 4096) == "natural"
    work = device_work(_config(4096, window_right=-1), 4, 4096, 4096)
    assert max(work) == min(work)
