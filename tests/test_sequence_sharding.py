"""Dense flash_attention with its sequence axis sharded under jax.jit (context parallelism in the
partitioned lowering, primitives/sequence_sharding.py): results and gradients equal the
one-device run and the reference, o keeps q's sharding, and the compiled program gathers no
q-sized array (q, o, lse, do, dq): the only all-gathers are of K/V.

Like tests/test_sharding.py, the checks need 4 devices: with fewer, `test_on_host_devices` runs
this file again in a subprocess with 4 CPU host devices.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import reference

from _util import randn, rel_err, run_on_host_devices

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
    gathered = _gathered_shapes(grad.lower(*sharded).compile().as_text())
    assert all(HQ not in s for s in gathered), gathered


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
