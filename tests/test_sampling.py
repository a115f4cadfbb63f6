"""sample and top_k_top_p_filter against a numpy transcription of the semantics, on every
platform: kept sets, statistical tests of the draws, determinism, edge cases, errors."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference
from jax_flash.ops.sampling import sample, top_k_top_p_filter

from _util import DTYPES

ALPHA = 1e-6  # false-alarm rate of each statistical check (fixed seeds make them repeatable)


def _cpu(*xs):
    cpu = jax.devices("cpu")[0]
    out = [jax.device_put(x, cpu) for x in xs]
    return out if len(out) > 1 else out[0]


def oracle(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """(kept [B, V] bool, probs [B, V] float64): the kept set and the renormalised distribution
    of every row, straight from the documented semantics (float64, one row at a time)."""
    x = np.asarray(jnp.asarray(logits).astype(jnp.float32), np.float64)
    B, V = x.shape

    def rows(v, dtype):
        return np.broadcast_to(np.asarray(v, dtype), (B,))

    T, K, P, M = (
        rows(temperature, np.float64),
        rows(top_k, np.int64),
        rows(top_p, np.float64),
        rows(min_p, np.float64),
    )
    kept, probs = np.zeros((B, V), bool), np.zeros((B, V))
    for b in range(B):
        xb = np.where(np.isnan(x[b]), -np.inf, x[b])
        order = np.lexsort((np.arange(V), -xb))  # logit descending, index ascending
        if xb[order[0]] == -np.inf:
            continue
        if not T[b] > 0:
            kept[b, order[0]], probs[b, order[0]] = True, 1.0
            continue
        d = (xb[order] - xb[order[0]]) / T[b]
        p = np.exp(d)
        n = K[b] if 0 < K[b] < V else V
        if P[b] < 1:
            cum = np.cumsum(p[:n])
            n = min(n, int(np.argmax(cum >= P[b] * cum[-1])) + 1)
        if M[b] > 0:
            n = min(n, int(np.sum(d >= np.log(min(M[b], 1.0)))))
        n = max(n, 1)
        kept[b, order[:n]] = True
        probs[b, order[:n]] = p[:n] / p[:n].sum()
    return kept, probs


def chi2_upper(df: int, alpha: float) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty approximation."""
    z = math.sqrt(2) * _erfcinv(2 * alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _erfcinv(y: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid) > y else (lo, mid)
    return lo


def check_distribution(tokens, probs):
    """tokens: N draws from the distribution probs [V]. Every token must have positive
    probability; counts must pass a chi-square test (cells with expectation < 5 lumped) at
    level ALPHA, and every frequency must lie within the Hoeffding bound
    sqrt(log(2 V / ALPHA) / (2 N)) of its probability (union bound over V)."""
    tokens = np.asarray(tokens).reshape(-1)
    N = tokens.size
    assert np.all(probs[tokens] > 0), (
        f"drew tokens outside the kept set: {np.unique(tokens[probs[tokens] == 0])}"
    )
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    expected = N * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    if obs.size > 1:
        stat = float(np.sum((obs - exp) ** 2 / exp))
        bound = chi2_upper(obs.size - 1, ALPHA)
        assert stat <= bound, f"chi-square {stat:.1f} > {bound:.1f} (df {obs.size - 1}, N {N})"
    dev = float(np.max(np.abs(counts / N - probs)))
    hoeffding = math.sqrt(math.log(2 * probs.size / ALPHA) / (2 * N))
    assert dev <= hoeffding, f"max |freq - prob| {dev:.4f} > {hoeffding:.4f}"


def _logits(rng, B, V, dtype=jnp.float32, scale=3.0):
    return jnp.asarray(rng.standard_normal((B, V), dtype=np.float32) * scale).astype(dtype)


CONFIGS = [
    dict(),
    dict(temperature=0.0),
    dict(top_k=5),
    dict(top_k=1, temperature=2.0),
    dict(top_p=0.9),
    dict(top_p=1e-9),
    dict(min_p=0.05),
    dict(min_p=1.0),
    dict(temperature=0.7, top_k=50, top_p=0.8, min_p=0.02),
    dict(temperature=1.5, top_k=3000, top_p=0.95),
]


def per_row(configs, rows_each):
    """Per-row [B] parameter arrays holding each config for rows_each rows."""
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    cols = {
        n: [c.get(n, d) for c in configs for _ in range(rows_each)] for n, d in defaults.items()
    }
    return {n: np.asarray(v, np.int32 if n == "top_k" else np.float32) for n, v in cols.items()}


@pytest.mark.parametrize("V", [1, 7, 1003, 4096, 50001])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_filter_matches_oracle(platform, rng, V, dtype):
    """Every config of CONFIGS on 3 rows each, in one call (per-row parameters)."""
    cfg = per_row(CONFIGS, 3)
    logits = _logits(rng, 3 * len(CONFIGS), V, DTYPES[dtype])
    fn = jax.jit(functools.partial(top_k_top_p_filter, implementation=platform.name))
    out = fn(platform.put(logits), **{n: platform.put(jnp.asarray(v)) for n, v in cfg.items()})
    out = np.asarray(_cpu(out).astype(jnp.float32))
    kept, _ = oracle(logits, **cfg)
    for b in range(out.shape[0]):
        np.testing.assert_array_equal(
            out[b] > -np.inf, kept[b], err_msg=f"kept set differs, {CONFIGS[b // 3]}"
        )
    t = cfg["temperature"][:, None]
    x = np.asarray(logits.astype(jnp.float32))
    scaled = jnp.asarray(x / np.where(t == 0, 1, t)).astype(logits.dtype).astype(jnp.float32)
    expect = np.where(t == 0, x, np.asarray(scaled))
    np.testing.assert_array_equal(out[kept], expect[kept])


@pytest.mark.parametrize(
    "cfg", CONFIGS[1:], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize("V", [7, 1003, 50001])
def test_sample_inside_kept_set(platform, rng, cfg, V):
    logits = _logits(rng, 64, V, jnp.bfloat16)
    fn = jax.jit(functools.partial(sample, implementation=platform.name, **cfg))
    kept, _ = oracle(logits, **cfg)
    for seed in range(3):
        tokens = np.asarray(_cpu(fn(platform.put(logits), jax.random.key(seed))))
        assert tokens.dtype == np.int32 and tokens.shape == (64,)
        assert np.all(kept[np.arange(64), tokens]), "a token outside the kept set"


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(temperature=0.8, top_k=20),
        dict(top_p=0.7),
        dict(temperature=1.3, top_k=30, top_p=0.9, min_p=0.02),
        dict(min_p=0.1),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distribution_over_rows(platform, cfg, dtype):
    """20000 rows holding the same logits (independent Philox streams per row)."""
    rng = np.random.default_rng(1234)
    row = _logits(rng, 1, 50, DTYPES[dtype], scale=1.5)
    logits = jnp.broadcast_to(row, (20000, 50))
    tokens = sample(*platform.put(logits, jax.random.key(7)), implementation=platform.name, **cfg)
    _, probs = oracle(row, **cfg)
    check_distribution(_cpu(tokens), probs[0])


def test_distribution_over_keys(platform):
    """One row, 20000 keys through vmap: the batching rule and the key -> seed derivation."""
    rng = np.random.default_rng(99)
    row = _logits(rng, 1, 37, scale=1.0)
    cfg = dict(temperature=0.9, top_k=25, top_p=0.95)
    keys = jax.random.split(jax.random.key(3), 20000)
    fn = jax.jit(
        jax.vmap(functools.partial(sample, implementation=platform.name, **cfg), in_axes=(None, 0))
    )
    tokens = fn(*platform.put(row, keys))
    assert tokens.shape == (20000, 1)
    _, probs = oracle(row, **cfg)
    check_distribution(_cpu(tokens), probs[0])


def test_distribution_with_ties(platform):
    """Equal logits: top_k cuts a tie by index; the draw is uniform among equal kept logits."""
    row = jnp.asarray([[1.0, 2.0, 2.0, 0.5, 2.0, 2.0, 1.0, -jnp.inf, 2.0, 1.0]], jnp.float32)
    logits = jnp.broadcast_to(row, (20000, 10))
    for cfg in (dict(top_k=3), dict(top_k=7), dict(top_p=0.5), dict(min_p=0.5)):
        tokens = sample(
            *platform.put(logits, jax.random.key(11)), implementation=platform.name, **cfg
        )
        kept, probs = oracle(row, **cfg)
        check_distribution(_cpu(tokens), probs[0])
    kept, _ = oracle(row, top_k=3)
    assert list(np.flatnonzero(kept[0])) == [1, 2, 4]


def test_determinism(platform, rng):
    logits = platform.put(_logits(rng, 33, 3001))
    cfg = dict(temperature=0.8, top_k=100, top_p=0.9, implementation=platform.name)
    key = jax.random.key(5)
    eager = np.asarray(sample(logits, key, **cfg))
    jitted = jax.jit(functools.partial(sample, **cfg))
    np.testing.assert_array_equal(np.asarray(jitted(logits, key)), eager)
    np.testing.assert_array_equal(np.asarray(jitted(logits, key)), eager)
    other = np.asarray(jitted(logits, jax.random.key(6)))
    assert np.any(other != eager), "another key gave the same 33 tokens"
    # vmap over keys and over logits draws what the separate calls draw.
    keys = jax.random.split(key, 4)
    stacked = jnp.stack([logits, logits[::-1], logits * 0.5, -logits])
    batched = jax.vmap(functools.partial(sample, **cfg))(stacked, keys)
    for i in range(4):
        np.testing.assert_array_equal(
            np.asarray(batched[i]), np.asarray(sample(stacked[i], keys[i], **cfg))
        )
    shared = jax.vmap(functools.partial(sample, **cfg), in_axes=(None, 0))(logits, keys)
    np.testing.assert_array_equal(np.asarray(shared[2]), np.asarray(sample(logits, keys[2], **cfg)))
    # Raw uint32 keys work too.
    raw = jax.random.key_data(key)
    np.testing.assert_array_equal(np.asarray(sample(logits, raw, **cfg)), eager)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_native_matches_reference(platform, rng, dtype):
    """The kernels and the jnp reference share the Philox uniforms: same tokens, except where a
    top-p cut or two Gumbel scores fall within float rounding (rare)."""
    logits = _logits(rng, 256, 1000, DTYPES[dtype])
    cfgs = [dict(), dict(temperature=0.6, top_k=40, top_p=0.9, min_p=0.01)]
    for cfg in cfgs:
        native = sample(
            *platform.put(logits, jax.random.key(2)), implementation=platform.name, **cfg
        )
        ref = sample(*_cpu(logits, jax.random.key(2)), implementation="xla", **cfg)
        mismatches = int(np.sum(np.asarray(_cpu(native)) != np.asarray(ref)))
        assert mismatches <= 2, f"{mismatches} of 256 tokens differ from the reference"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("V", [5, 1003, 4096, 131072])
def test_cuda_equals_cpu(platform, rng, dtype, V):
    """CPU and CUDA make bit-identical decisions: the same key gives the same tokens."""
    if platform.name != "cuda":
        pytest.skip("compares the CUDA kernel with the CPU kernel")
    logits = _logits(rng, 48, V, DTYPES[dtype])
    cfgs = [dict(), dict(temperature=0.7, top_k=50, top_p=0.9), dict(top_p=0.95, min_p=0.01)]
    for cfg in cfgs:
        gpu = sample(*platform.put(logits, jax.random.key(4)), implementation="cuda", **cfg)
        cpu = sample(*_cpu(logits, jax.random.key(4)), implementation="cpu", **cfg)
        np.testing.assert_array_equal(np.asarray(_cpu(gpu)), np.asarray(cpu), err_msg=str(cfg))
        fg = top_k_top_p_filter(platform.put(logits), implementation="cuda", **cfg)
        fc = top_k_top_p_filter(_cpu(logits), implementation="cpu", **cfg)
        np.testing.assert_array_equal(np.asarray(_cpu(fg)), np.asarray(fc), err_msg=str(cfg))


# ---------------------------------------------------------------------------------------------
# Edge cases


def test_greedy_and_ties(platform):
    logits = jnp.asarray(
        [[0.0, 3.0, 1.0, 3.0], [-1.0, -1.0, -1.0, -1.0], [5.0, -jnp.inf, 5.0, jnp.nan]], jnp.float32
    )
    key = jax.random.key(0)
    for cfg in (
        dict(temperature=0.0),
        dict(top_k=1),
        dict(top_p=1e-9),
        dict(top_k=1, temperature=5.0),
    ):
        tokens = sample(*platform.put(logits, key), implementation=platform.name, **cfg)
        np.testing.assert_array_equal(np.asarray(tokens), [1, 0, 0], err_msg=str(cfg))
    # min_p = 1 keeps exactly the tokens tied with the maximum.
    out = top_k_top_p_filter(platform.put(logits), min_p=1.0, implementation=platform.name)
    np.testing.assert_array_equal(
        np.isfinite(np.asarray(out)), [[0, 1, 0, 1], [1, 1, 1, 1], [1, 0, 1, 0]]
    )


def test_infinite_and_nan_logits(platform):
    row = [-jnp.inf, 0.0, jnp.nan, -jnp.inf, 1.0, -jnp.inf]
    logits = jnp.asarray([row, [-jnp.inf] * 6, [jnp.nan] * 6], jnp.float32)
    tokens = sample(
        *platform.put(jnp.repeat(logits, 200, axis=0), jax.random.key(1)),
        implementation=platform.name,
    )
    tokens = np.asarray(tokens).reshape(3, 200)
    assert set(tokens[0]) <= {1, 4} and len(set(tokens[0])) == 2
    assert np.all(tokens[1:] == -1), "a row without a finite logit gives -1"
    out = np.asarray(
        top_k_top_p_filter(platform.put(logits), top_k=3, implementation=platform.name)
    )
    assert np.all(out[1:] == -np.inf)
    # top_k = 3 keeps the two finite logits and, by index, the first -inf.
    np.testing.assert_array_equal(out[0], [-np.inf, 0.0, -np.inf, -np.inf, 1.0, -np.inf])
    greedy = sample(
        *platform.put(logits, jax.random.key(1)), temperature=0.0, implementation=platform.name
    )
    np.testing.assert_array_equal(np.asarray(greedy), [4, -1, -1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_tokens_is_greedy_sample(platform, rng, dtype):
    """argmax_tokens (one XLA reduction) picks what sample picks at temperature 0: ties to the
    lower index, NaN as -inf, +inf as the largest bfloat16, -1 without a finite logit."""
    B, V = 9, 1237
    x = rng.standard_normal((B, V)).astype(np.float32)
    x = np.round(x * 4) / 4  # many ties
    x[1, [5, 900]] = np.inf
    x[1, 7] = 3e38
    x[2, :] = -np.inf
    x[3, :] = np.nan
    x[4, ::2] = np.nan
    x[5, :] = 0.0
    x[5, 3:10] = -0.0
    x[6, 100:] = -np.inf
    with np.errstate(over="ignore"):  # 3e38 is +inf in float16
        logits = jnp.asarray(x, dtype)
    want = sample(*platform.put(logits, jax.random.key(3)), temperature=0.0,
                  implementation=platform.name)  # fmt: skip
    got = jax.jit(jax_flash.argmax_tokens)(platform.put(logits))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(got)[1] == 5 and np.all(np.asarray(got)[2:4] == -1)


def test_positive_infinity(platform):
    """+inf logits share all the probability (they count as the largest bfloat16)."""
    logits = jnp.tile(jnp.asarray([[1.0, jnp.inf, 3e38, jnp.inf, -jnp.inf]], jnp.float32), (400, 1))
    tokens = np.asarray(
        sample(*platform.put(logits, jax.random.key(2)), implementation=platform.name)
    )
    assert set(tokens) == {1, 3}
    greedy = sample(
        *platform.put(logits, jax.random.key(2)), temperature=0.0, implementation=platform.name
    )
    assert set(np.asarray(greedy)) == {1}


def test_vocab_of_one(platform):
    logits = jnp.asarray([[2.0], [-jnp.inf], [0.0]], jnp.bfloat16)
    tokens = sample(
        *platform.put(logits, jax.random.key(0)), top_p=0.5, implementation=platform.name
    )
    np.testing.assert_array_equal(np.asarray(tokens), [0, -1, 0])


def test_per_row_parameters(platform, rng):
    B, V = 6, 2001
    logits = _logits(rng, B, V)
    cfg = dict(
        temperature=jnp.asarray([0.0, 1.0, 0.5, 2.0, 1.0, 0.8], jnp.float32),
        top_k=jnp.asarray([0, 1, 10, 0, 2000, 5000], jnp.int32),
        top_p=jnp.asarray([1.0, 1.0, 0.5, 0.9, 1.0, -1.0], jnp.float32),
        min_p=jnp.asarray([0.0, 0.0, 0.0, 0.1, 2.0, 0.0], jnp.float32),
    )
    kept, _ = oracle(logits, **{k: np.asarray(v) for k, v in cfg.items()})
    assert kept.sum(axis=1)[[0, 1, 5]].tolist() == [1, 1, 1]
    out = top_k_top_p_filter(
        platform.put(logits), implementation=platform.name, **platform_put(platform, cfg)
    )
    np.testing.assert_array_equal(np.isfinite(np.asarray(_cpu(out))), kept)
    for seed in range(4):
        tokens = sample(
            *platform.put(logits, jax.random.key(seed)),
            implementation=platform.name,
            **platform_put(platform, cfg),
        )
        assert np.all(kept[np.arange(B), np.asarray(_cpu(tokens))])
    # A Python scalar broadcasts over rows like a [B] array of that value.
    a = sample(*platform.put(logits, jax.random.key(0)), top_k=7, implementation=platform.name)
    b = sample(
        *platform.put(logits, jax.random.key(0)),
        top_k=jnp.full((B,), 7),
        implementation=platform.name,
    )
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def platform_put(platform, cfg):
    return {k: platform.put(v) for k, v in cfg.items()}


def test_empty_batch(platform):
    logits = jnp.zeros((0, 10), jnp.float32)
    assert sample(platform.put(logits), jax.random.key(0), implementation=platform.name).shape == (
        0,
    )
    assert top_k_top_p_filter(
        platform.put(logits), top_k=2, implementation=platform.name
    ).shape == (0, 10)


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    u32 = functools.partial(jnp.asarray, dtype=jnp.uint32)
    cases = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (
            [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
            [0xA4093822, 0x299F31D0],
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        ),
    ]
    for ctr, key, expected in cases:
        np.testing.assert_array_equal(
            np.asarray(reference.philox4x32_10(u32(ctr), u32(key))), expected
        )


@pytest.mark.skipif(not jax_flash.has_cuda_kernels(), reason="built without CUDA kernels")
def test_cuda_lowering_without_gpu():
    logits = jnp.zeros((2, 100), jnp.bfloat16)
    f = functools.partial(sample, top_k=5)
    text = jax.jit(f).trace(logits, jax.random.key(0)).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_flash_sample_cuda" in text
    text = jax.jit(top_k_top_p_filter).trace(logits).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_flash_top_k_top_p_filter_cuda" in text


def test_default_implementation_runs_natively():
    logits = jnp.zeros((2, 100), jnp.float32)
    hlo = jax.jit(sample).lower(logits, jax.random.key(0)).as_text()
    assert "jax_flash_sample_" in hlo


def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "logits,kwargs,exc,match",
    [
        (_z(10), {}, ValueError, r"logits must have rank 2"),
        (_z(2, 10, dtype=jnp.int32), {}, TypeError, "logits has dtype int32"),
        (_z(2, 0), {}, ValueError, "vocabulary size"),
        (_z(2, 10), dict(temperature=-1.0), ValueError, "temperature must be finite and >= 0"),
        (_z(2, 10), dict(temperature=float("inf")), ValueError, "temperature"),
        (_z(2, 10), dict(top_k=-1), ValueError, "top_k must be >= 0"),
        (_z(2, 10), dict(top_k=2.5), TypeError, "top_k must be an integer"),
        (_z(2, 10), dict(top_k=True), TypeError, "bool"),
        (_z(2, 10), dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (_z(2, 10), dict(top_p=1.5), ValueError, "top_p"),
        (_z(2, 10), dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
        (
            _z(2, 10),
            dict(top_k=jnp.zeros((3,), jnp.int32)),
            ValueError,
            r"top_k must be a scalar or have shape \(2,\)",
        ),
        (_z(2, 10), dict(top_k=jnp.zeros((2,))), TypeError, "top_k must be an integer"),
        (_z(2, 10), dict(top_p="0.9"), TypeError, "top_p must be a number"),
        (_z(2, 10), dict(implementation="triton"), ValueError, "implementation"),
    ],
)
def test_errors(logits, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sample(logits, jax.random.key(0), **kwargs)
    with pytest.raises(exc, match=match):
        top_k_top_p_filter(logits, **kwargs)


@pytest.mark.parametrize(
    "key,exc,match",
    [
        (jax.random.split(jax.random.key(0), 2), ValueError, r"one PRNG key \(shape \(\)\)"),
        (jnp.zeros((3,), jnp.uint32), TypeError, "key must be a JAX PRNG key"),
        (0, TypeError, "key must be a JAX PRNG key"),
    ],
)
def test_key_errors(key, exc, match):
    with pytest.raises(exc, match=match):
        sample(_z(2, 10), key)
