"""Every primitive under a mesh: results equal the one-device run, batch and head shardings
compile to no collective, outputs keep the inputs' sharding; shard_map, explicit sharding mode
and the GSPMD partitioner too.

The checks need 4 devices. With fewer (a CPU test run), `test_on_host_devices` runs this file
again in a subprocess with 4 CPU host devices (XLA_FLAGS is read when jax starts, so the rest of
the suite keeps its one device); on a machine with 4+ GPUs (or CPUs) the checks run in place.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash

from _util import randn

DEVICES = 4
_CHILD = "JAX_FLASH_SHARDING_CHILD"
_ENOUGH = jax.device_count() >= DEVICES
needs_devices = pytest.mark.skipif(not _ENOUGH, reason=f"needs {DEVICES} devices")
COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\("
)


@pytest.mark.skipif(_ENOUGH or os.environ.get(_CHILD) == "1", reason="checks run in place")
def test_on_host_devices():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    env[_CHILD] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(__file__),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    # The checks ran (none skipped for want of devices).
    assert " passed" in run.stdout and f"needs {DEVICES} devices" not in run.stdout, run.stdout


def _mesh(axis_type=AxisType.Auto):
    devices = jax.devices()[:DEVICES]
    return jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "model"), (axis_type,) * 2)


def _norm(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(None if e in (None, ()) else e for e in entries)


def _collectives(f, args):
    return sorted({m[0] for m in COLLECTIVE.findall(f.lower(*args).compile().as_text())})


def one_device(fn, args):
    return jax.jit(fn)(*[jax.device_put(a, jax.devices()[0]) for a in args])


def check(fn, args, specs, out_specs, *, collectives=False, mesh=None, single=None):
    """fn jitted on sharded args equals fn on one device (or `single`); the outputs have
    `out_specs` (None: not checked); with collectives=False the compiled program has none."""
    mesh = _mesh() if mesh is None else mesh
    single = one_device(fn, args) if single is None else single
    sharded_args = [
        jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)
    ]
    f = jax.jit(fn)
    out = f(*sharded_args)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
    if out_specs is not None:
        got = [_norm(o.sharding.spec, o.ndim) for o in jax.tree.leaves(out)]
        want = [_norm(s, o.ndim) for s, o in zip(out_specs, jax.tree.leaves(out), strict=True)]
        assert got == want
    if not collectives:
        assert _collectives(f, sharded_args) == []
    return f, sharded_args


def _prefill_inputs(rng, B=4, S=9, Skv=11, Hq=6, Hkv=2, D=16):
    q = randn(rng, (B, S, Hq, D), jnp.float32)
    k = randn(rng, (B, Skv, Hkv, D), jnp.float32)
    v = randn(rng, (B, Skv, Hkv, D), jnp.float32)
    return q, k, v


@needs_devices
@pytest.mark.parametrize(
    "spec", [P("data"), P(None, None, "model"), P("data", None, "model"), P(("data", "model"))]
)
def test_prefill_batch_and_heads(rng, spec):
    q, k, v = _prefill_inputs(rng)
    q_lens = jnp.asarray(rng.integers(0, 10, 4), jnp.int32)
    kv_lens = jnp.asarray(rng.integers(1, 12, 4), jnp.int32)

    def fn(q, k, v, ql, kl):
        return jax_flash.flash_attention(
            q, k, v, causal=True, q_seqlens=ql, kv_seqlens=kl, return_lse=True
        )

    lens = P(spec[0]) if spec[0] else P()
    lse = P(spec[0], spec[2] if len(spec) > 2 else None)
    check(fn, (q, k, v, q_lens, kv_lens), [spec] * 3 + [lens] * 2, [spec, lse])


@needs_devices
def test_prefill_vmapped(rng):
    # The batching rule folds the vmapped axis into the rows; the folded call is partitioned.
    q, k, v = (x.reshape(2, 2, *x.shape[1:]) for x in _prefill_inputs(rng))
    fn = jax.vmap(lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=True))
    spec = P("data", None, None, "model")
    check(fn, (q, k, v), [spec] * 3, [spec])


@needs_devices
def test_prefill_sequence_sharded_is_gathered(rng):
    # 4 sequences over 2 devices hold 2 each: a split of their rows would not be one block of
    # the packed rows, so the sequence is gathered (exact). Sequence shards of one sequence per
    # device run context parallelism: tests/test_sequence_sharding.py.
    q, k, v = _prefill_inputs(rng, S=8, Skv=12)
    fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=True)  # noqa: E731
    check(fn, (q, k, v), [P("data", "model")] * 3, None, collectives=True)


@needs_devices
def test_prefill_gqa_fallbacks(rng):
    # q heads split 4 ways over 2 kv heads: no contiguous kv-head block per shard, so the heads
    # are gathered (exact). One kv head (MQA): the q heads of the group split, k/v replicated.
    q, k, v = _prefill_inputs(rng, Hq=8, Hkv=2)
    fn = lambda q, k, v: jax_flash.flash_attention(q, k, v)  # noqa: E731
    heads4 = P(None, None, ("data", "model"))
    check(fn, (q, k, v), [heads4, P(), P()], None, collectives=True)
    q, k, v = _prefill_inputs(rng, Hq=6, Hkv=1)
    check(fn, (q, k, v), [P(None, None, "model"), P(), P()], [P(None, None, "model")])


@needs_devices
def test_varlen_heads(rng):
    cu = jnp.asarray([0, 5, 21, 24], jnp.int32)
    q = randn(rng, (24, 6, 16), jnp.float32)
    k = randn(rng, (24, 2, 16), jnp.float32)
    v = randn(rng, (24, 2, 8), jnp.float32)

    def fn(q, k, v, cu):
        return jax_flash.flash_attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)

    heads = P(None, "model")
    check(fn, (q, k, v, cu), [heads, heads, heads, P()], [heads, P("model")])
    # The packed rows hold sequences of any length: a row sharding is gathered, exactly.
    check(fn, (q, k, v, cu), [P("data")] * 3 + [P()], None, collectives=True)


def _paged_inputs(rng, B=4, Hq=6, Hkv=2, D=16, page=4, pages=40, max_pages=7, quant=None):
    q = randn(rng, (B, Hq, D), jnp.float32)
    kp = randn(rng, (pages, page, Hkv, D), jnp.float32)
    vp = randn(rng, (pages, page, Hkv, D), jnp.float32)
    bt = jnp.asarray(rng.permutation(pages)[: B * max_pages].reshape(B, max_pages), jnp.int32)
    lens = jnp.asarray(rng.integers(0, page * max_pages + 1, B), jnp.int32)
    scales = {}
    if quant is not None:
        shape = (Hkv,) if quant == "head" else (pages, page, Hkv)
        ks = jnp.asarray(rng.uniform(0.01, 0.03, shape), jnp.float32)
        vs = jnp.asarray(rng.uniform(0.01, 0.03, shape), jnp.float32)
        kp, vp = (jnp.clip(jnp.round(x * 40), -127, 127).astype(jnp.int8) for x in (kp, vp))
        scales = {"k_scale": ks, "v_scale": vs}
    return q, kp, vp, bt, lens, scales


@needs_devices
@pytest.mark.parametrize("quant", [None, "head", "token"])
def test_paged_decode_batch_and_heads(rng, quant):
    q, kp, vp, bt, lens, scales = _paged_inputs(rng, quant=quant)
    pool = P(None, None, "model")
    scale_spec = P("model") if quant == "head" else pool

    def fn(q, kp, vp, bt, lens, *s):
        kw = dict(zip(("k_scale", "v_scale"), s, strict=False))
        return jax_flash.paged_attention(q, kp, vp, bt, lens, num_splits=2, return_lse=True, **kw)

    extra = [scales[n] for n in ("k_scale", "v_scale") if n in scales]
    specs = [P("data", "model"), pool, pool, P("data"), P("data")] + [scale_spec] * len(extra)
    check(fn, (q, kp, vp, bt, lens, *extra), specs, [P("data", "model")] * 2)


@needs_devices
def test_paged_chunked_prefill_queries(rng):
    # Several queries per sequence (causal): their rows stay whole; batch and heads split.
    _, kp, vp, bt, _, _ = _paged_inputs(rng)
    q = randn(rng, (4, 3, 6, 16), jnp.float32)
    lens = jnp.asarray(rng.integers(3, 29, 4), jnp.int32)
    fn = lambda q, kp, vp, bt, lens: jax_flash.paged_attention(q, kp, vp, bt, lens)  # noqa: E731
    pool = P(None, None, "model")
    specs = [P("data", None, "model"), pool, pool, P("data"), P("data")]
    check(fn, (q, kp, vp, bt, lens), specs, [P("data", None, "model")])


@needs_devices
@pytest.mark.parametrize("rope", [False, True])
def test_append_kv_heads(rng, rope):
    _, kp, vp, _, _, _ = _paged_inputs(rng)
    k_new = randn(rng, (5, 2, 16), jnp.float32)
    v_new = randn(rng, (5, 2, 16), jnp.float32)
    q = randn(rng, (5, 6, 16), jnp.float32)
    slots = jnp.asarray(rng.permutation(160)[:5], jnp.int32).at[2].set(-1)
    pos = jnp.asarray(rng.integers(0, 500, 5), jnp.int32)

    def fn(kp, vp, k_new, v_new, slots, q, pos):
        if not rope:
            return jax_flash.append_kv(kp, vp, k_new, v_new, slots)
        extra = dict(positions=pos, rope={"theta": 500000.0}, q=q)
        return jax_flash.append_kv(kp, vp, k_new, v_new, slots, **extra)

    pool, heads = P(None, None, "model"), P(None, "model")
    specs = [pool, pool, heads, heads, P(), heads, P()]
    outs = ([heads] if rope else []) + [pool, pool]
    check(fn, (kp, vp, k_new, v_new, slots, q, pos), specs, outs)


@needs_devices
def test_append_kv_quantized_heads(rng):
    _, kp, vp, _, _, scales = _paged_inputs(rng, quant="head")
    k_new = randn(rng, (5, 2, 16), jnp.float32)
    slots = jnp.asarray(rng.permutation(160)[:5], jnp.int32)

    def fn(kp, vp, k_new, slots, ks, vs):
        return jax_flash.append_kv(kp, vp, k_new, k_new, slots, k_scale=ks, v_scale=vs)

    pool = P(None, None, "model")
    specs = [pool, pool, P(None, "model"), P(), P("model"), P("model")]
    check(fn, (kp, vp, k_new, slots, scales["k_scale"], scales["v_scale"]), specs,
          [pool, pool, P("model"), P("model")])  # fmt: skip


@needs_devices
def test_reorder_beams_heads(rng):
    _, kp, vp, bt, _, _ = _paged_inputs(rng, pages=40, max_pages=7)
    bt = bt[:, :5]
    lens = jnp.full((4,), 18, jnp.int32)
    spare = jnp.asarray(np.setdiff1d(np.arange(40), np.asarray(bt))[:4], jnp.int32)
    beams = jnp.asarray([2, 2, 0, 3], jnp.int32)

    def fn(bt, lens, beams, spare, kp, vp):
        return jax_flash.reorder_beams(bt, lens, beams, spare, kp, vp)

    pool = P(None, None, "model")
    check(fn, (bt, lens, beams, spare, kp, vp), [P(), P(), P(), P(), pool, pool],
          [P(), P(), P(), pool, pool])  # fmt: skip


@needs_devices
@pytest.mark.parametrize(
    "shape, spec", [((4, 6, 6, 16), P("data", None, "model")), ((24, 6, 16), P(("data", "model")))]
)
def test_apply_rope_tokens_and_heads(rng, shape, spec):
    x = randn(rng, shape, jnp.float32)
    pos = jnp.asarray(rng.integers(0, 1000, shape[:-2]), jnp.int32)
    fn = lambda x, pos: jax_flash.apply_rope(x, pos, rotary_dim=8, style="gptj")  # noqa: E731
    check(fn, (x, pos), [spec, P(*spec[: len(shape) - 2])], [spec])


@needs_devices
def test_sampling_batch(rng):
    logits = randn(rng, (8, 302), jnp.float32)
    temp = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32)

    def fn(logits, temp):
        tokens = jax_flash.sample(logits, jax.random.key(3), temperature=temp, top_k=20, top_p=0.9)
        return tokens, jax_flash.top_k_top_p_filter(logits, top_k=7, temperature=temp)

    rows = P(("data", "model"))
    check(fn, (logits, temp), [rows, rows], [rows, rows])
    # The vocabulary stays whole: a vocabulary sharding is gathered, exactly.
    check(fn, (logits, temp), [P(None, "model"), P()], None, collectives=True)


@needs_devices
def test_shard_map_per_device_calls(rng):
    q, k, v = _prefill_inputs(rng)
    qd, kp, vp, bt, lens, _ = _paged_inputs(rng)
    mesh = _mesh()

    def fn(q, k, v, qd, kp, vp, bt, lens):
        o = jax_flash.flash_attention(q, k, v, causal=True)
        od = jax_flash.paged_attention(qd, kp, vp, bt, lens)
        return o, od

    pool = P(None, None, "model")
    specs = (P("data", None, "model"),) * 3 + (P("data", "model"), pool, pool, P("data"), P("data"))
    out_specs = (P("data", None, "model"), P("data", "model"))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_specs)
    args = (q, k, v, qd, kp, vp, bt, lens)
    check(mapped, args, specs, out_specs, mesh=mesh, single=one_device(fn, args))


@needs_devices
def test_explicit_sharding_mode(rng):
    q, k, v = _prefill_inputs(rng)
    qd, kp, vp, bt, lens, _ = _paged_inputs(rng)
    mesh = _mesh(AxisType.Explicit)
    pool = P(None, None, "model")
    fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=True)  # noqa: E731

    def decode(qd, kp, vp, bt, lens):
        return jax_flash.paged_attention(qd, kp, vp, bt, lens)

    single = one_device(fn, (q, k, v))
    single_decode = one_device(decode, (qd, kp, vp, bt, lens))
    with jax.set_mesh(mesh):
        spec = P("data", None, "model")
        _, args = check(fn, (q, k, v), [spec] * 3, [spec], mesh=mesh, single=single)
        # The output's type carries its sharding (explicit mode).
        assert _norm(jax.typeof(jax.jit(fn)(*args)).sharding.spec, 4) == _norm(spec, 4)
        specs = [P("data", "model"), pool, pool, P("data"), P("data")]
        check(decode, (qd, kp, vp, bt, lens), specs, [P("data", "model")], mesh=mesh,
              single=single_decode)  # fmt: skip
        # A pool split on its pages cannot be taken as it is (block tables hold global page
        # ids): explicit mode inserts no gather on its own, so the call says what to reshard.
        bad_specs = [P(), P("data"), P("data"), P(), P()]
        bad = [
            jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((qd, kp, vp, bt, lens), bad_specs, strict=True)
        ]
        with pytest.raises(ValueError, match="reshard"):
            jax.jit(decode)(*bad)


@needs_devices
def test_gspmd_partitioner(rng):
    q, k, v = _prefill_inputs(rng)
    qd, kp, vp, bt, lens, _ = _paged_inputs(rng)
    pool = P(None, None, "model")
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=True)  # noqa: E731
        spec = P("data", None, "model")
        check(fn, (q, k, v), [spec] * 3, [spec])

        def decode(qd, kp, vp, bt, lens):
            return jax_flash.paged_attention(qd, kp, vp, bt, lens)

        specs = [P("data", "model"), pool, pool, P("data"), P("data")]
        check(decode, (qd, kp, vp, bt, lens), specs, [P("data", "model")])
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
