"""apply_rope against a numpy transcription of Hugging Face's formulas, on every platform."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import reference
from jax_flash.ops.rope import apply_rope

from _util import DTYPES, LINEAR, LLAMA3, randn, rel_err, tolerance


def _cpu(*xs):
    cpu = jax.devices("cpu")[0]
    out = [jax.device_put(x, cpu) for x in xs]
    return out if len(out) > 1 else out[0]


def np_rope(x, positions, inv_freq, style, rotary_dim):
    """Hugging Face's formulas in float64 on the float32 angles float32(pos) * inv_freq:
    NeoX (Llama): x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) =
    cat(-x2, x1); GPT-J: x * repeat_interleave(cos) + rotate_every_two(x) * repeat_interleave(sin),
    rotate_every_two(x) = interleave(-x_odd, x_even)."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    pos = np.broadcast_to(np.asarray(positions), x.shape[:-2]).astype(np.float32)
    angle = (pos[..., None] * inv_freq).astype(np.float32).astype(np.float64)[..., None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    if style == "neox":
        cos2, sin2 = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
        rotated = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
    else:
        cos2, sin2 = np.repeat(cos, 2, -1), np.repeat(sin, 2, -1)
        rotated = np.stack([-rot[..., 1::2], rot[..., 0::2]], -1).reshape(rot.shape)
    return np.concatenate([rot * cos2 + rotated * sin2, rest], -1)


def _check(platform, out, x, positions, style, rotary_dim, theta, scaling):
    inv_freq = reference.rope_inv_freq(rotary_dim, theta, scaling)
    ref = np_rope(x, positions, inv_freq, style, rotary_dim)
    # A perfect result rounded to x's dtype makes this error; the kernel may make twice that
    # (float32 cos/sin and rotation) plus one rounding unit.
    same = rel_err(jnp.asarray(ref, jnp.float32).astype(x.dtype), ref)
    tol = tolerance(x.dtype, same)
    err = rel_err(out, ref)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert err <= tol, f"{platform}: relative error {err:.3g} > tolerance {tol:.3g}"
    # Features past rotary_dim are copied bit for bit.
    np.testing.assert_array_equal(
        np.asarray(out[..., rotary_dim:]), np.asarray(x[..., rotary_dim:])
    )


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "shape,rotary_dim",
    [
        ((1, 1, 1, 2), None),
        ((2, 7, 3, 64), None),
        ((3, 97, 5, 128), 64),  # partial rotary dim (GPT-NeoX style)
        ((1, 33, 2, 10), 6),  # odd sizes, a pass-through tail of 4
        ((2, 5, 4, 256), None),
    ],
)
def test_rope(platform, rng, style, dtype, shape, rotary_dim):
    x = randn(rng, shape, DTYPES[dtype])
    S = shape[1]
    positions = jnp.asarray(rng.integers(-50, 40000, size=(shape[0], S)), jnp.int32)
    rd = shape[-1] if rotary_dim is None else rotary_dim
    fn = functools.partial(
        apply_rope, style=style, rotary_dim=rotary_dim, implementation=platform.name
    )
    out = jax.jit(fn)(*platform.put(x, positions))
    _check(platform, _cpu(out), x, positions, style, rd, 10000.0, None)


@pytest.mark.parametrize("scaling", [None, LINEAR, LLAMA3, {"rope_type": "default"}])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_scaling(platform, rng, scaling, style):
    x = randn(rng, (2, 31, 4, 128), jnp.float32)
    # Positions beyond the original context, where the Llama 3 scaling matters.
    positions = jnp.asarray(rng.integers(0, 131072, size=(31,)), jnp.int32)
    fn = functools.partial(
        apply_rope, style=style, theta=500000.0, scaling=scaling, implementation=platform.name
    )
    out = jax.jit(fn)(*platform.put(x, positions))
    _check(platform, _cpu(out), x, positions, style, 128, 500000.0, scaling)


def test_large_positions(platform, rng):
    x = randn(rng, (1, 8, 2, 64), jnp.float32)
    positions = jnp.asarray([0, 1, -1, 2**20, -(2**20), 2**24 - 1, 123457, 999999], jnp.int32)
    out = apply_rope(*platform.put(x, positions), implementation=platform.name)
    _check(platform, _cpu(out), x, positions, "neox", 64, 10000.0, None)


@pytest.mark.parametrize(
    "x_shape,pos_shape",
    [
        ((11, 3, 32), (11,)),  # [S, H, D]
        ((2, 3, 11, 3, 32), (11,)),  # [A, B, S, H, D], positions shared
        ((2, 3, 11, 3, 32), (3, 11)),  # broadcast over A
        ((2, 3, 11, 3, 32), (2, 3, 11)),
        ((4, 1, 2, 16), (4, 1)),  # decode: one token per sequence
    ],
)
def test_broadcast_positions(platform, rng, x_shape, pos_shape):
    x = randn(rng, x_shape, jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 5000, size=pos_shape), jnp.int32)
    out = apply_rope(*platform.put(x, positions), style="gptj", implementation=platform.name)
    _check(platform, _cpu(out), x, positions, "gptj", x_shape[-1], 10000.0, None)


def test_xla_implementation(rng):
    x = randn(rng, (2, 9, 3, 64), jnp.float16)
    positions = jnp.asarray(rng.integers(0, 9000, size=(2, 9)), jnp.int32)
    for style in ("neox", "gptj"):
        out = apply_rope(x, positions, style=style, scaling=LLAMA3, implementation="xla")
        _check("xla", out, x, positions, style, 64, 10000.0, LLAMA3)


def test_eager_jit_vmap(platform, rng):
    x = randn(rng, (5, 3, 13, 2, 32), jnp.float32)  # vmapped over the first axis
    positions = jnp.asarray(rng.integers(0, 1000, size=(5, 13)), jnp.int32)
    x, positions = platform.put(x, positions)
    fn = functools.partial(apply_rope, rotary_dim=16, implementation=platform.name)
    one = [np.asarray(fn(x[i], positions[i])) for i in range(5)]
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x[0], positions[0])), one[0])
    both = jax.jit(jax.vmap(fn))(x, positions)
    np.testing.assert_array_equal(np.asarray(both), np.stack(one))
    shared = jax.vmap(fn, in_axes=(0, None))(x, positions[0])
    np.testing.assert_array_equal(np.asarray(shared[2]), np.asarray(fn(x[2], positions[0])))
    only_pos = jax.vmap(fn, in_axes=(None, 0))(x[1], positions)
    np.testing.assert_array_equal(np.asarray(only_pos[3]), np.asarray(fn(x[1], positions[3])))
    nested = jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(1, None))(x, positions[0])
    np.testing.assert_array_equal(np.asarray(nested[1, 4]), np.asarray(fn(x[4, 1], positions[0])))


@pytest.mark.parametrize("style,scaling", [("neox", LLAMA3), ("gptj", LINEAR)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grad(platform, rng, style, scaling, dtype):
    """Reverse and forward mode (RoPE is linear in x: the transpose rotates back) against
    jax.grad / jax.jvp of the float32 reference, under jit and vmap."""
    x = randn(rng, (3, 11, 5, 48), dtype)
    positions = jnp.asarray(rng.integers(-50, 9000, size=(3, 11)), jnp.int32)
    weight = randn(rng, x.shape, jnp.float32)
    x, positions, weight = platform.put(x, positions, weight)
    opts = dict(style=style, rotary_dim=32, theta=500000.0, scaling=scaling)

    def loss(x, pos, w, impl):
        out = apply_rope(x, pos, implementation=impl, **opts).astype(jnp.float32)
        return jnp.sum(out * w)

    ref = jax.grad(loss)(x.astype(jnp.float32), positions, weight, "xla")
    same = rel_err(ref.astype(dtype), ref)
    tol = tolerance(dtype, same)
    grad = jax.jit(jax.grad(loss), static_argnums=3)(x, positions, weight, platform.name)
    assert grad.dtype == x.dtype
    assert rel_err(grad, ref) <= tol
    per_row = jax.vmap(jax.grad(loss), in_axes=(0, 0, 0, None))(
        x[:, None], positions[:, None], weight[:, None], platform.name
    )
    assert rel_err(per_row[:, 0], ref) <= tol
    tangent = weight.astype(dtype)
    _, jvp = jax.jvp(
        lambda x: apply_rope(x, positions, implementation=platform.name, **opts), (x,), (tangent,)
    )
    ref_jvp = apply_rope(tangent.astype(jnp.float32), positions, implementation="xla", **opts)
    assert rel_err(jvp, ref_jvp) <= tol


def test_empty(platform):
    x = jnp.zeros((2, 0, 4, 64), jnp.bfloat16)
    out = apply_rope(*platform.put(x, jnp.zeros((2, 0), jnp.int32)), implementation=platform.name)
    assert out.shape == x.shape


def test_inv_freq_matches_transformers():
    """Against a float64 transcription of transformers' _compute_llama3_parameters."""
    dim, base = 128, 500000.0
    inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    expected = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    got = reference.rope_inv_freq(dim, base, LLAMA3)
    assert got.dtype == np.float32 and got.shape == (64,)
    np.testing.assert_allclose(got, expected, rtol=2e-6)
    assert np.any(got != reference.rope_inv_freq(dim, base))  # the scaling changed something
    np.testing.assert_array_equal(
        reference.rope_inv_freq(dim, base, LINEAR),
        reference.rope_inv_freq(dim, base) / np.float32(4.0),
    )
    np.testing.assert_allclose(
        reference.rope_inv_freq(8, 10000.0), [1, 0.1, 0.01, 0.001], rtol=1e-6
    )


def test_rotary_dim_beyond_native_kernels(rng):
    x = randn(rng, (1, 3, 1, 1024), jnp.float32)
    positions = jnp.arange(3, dtype=jnp.int32)
    with pytest.raises(ValueError, match="rotary_dim up to 512.*implementation='xla'"):
        apply_rope(x, positions)
    out = apply_rope(x, positions, implementation="xla")
    _check("xla", out, x, positions, "neox", 1024, 10000.0, None)


@pytest.mark.skipif(
    not __import__("jax_flash").has_cuda_kernels(), reason="built without CUDA kernels"
)
def test_cuda_lowering_without_gpu():
    x = jnp.zeros((2, 4, 2, 64), jnp.bfloat16)
    positions = jnp.zeros((4,), jnp.int32)
    text = jax.jit(apply_rope).trace(x, positions).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_flash_apply_rope_cuda" in text


def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "x,positions,kwargs,exc,match",
    [
        (_z(4, 64), _z(4, dtype=jnp.int32), {}, ValueError, r"rank >= 3.*\(4, 64\)"),
        (_z(4, 2, 64, dtype=jnp.int32), _z(4, dtype=jnp.int32), {}, TypeError, "x has dtype int32"),
        ("x", _z(4, dtype=jnp.int32), {}, TypeError, "x must be an array"),
        (_z(4, 2, 64), _z(4), {}, TypeError, "positions must be an integer array"),
        (_z(4, 2, 64), _z(5, dtype=jnp.int32), {}, ValueError, r"broadcast.*\(4,\).*\(5,\)"),
        (_z(3, 4, 2, 64), _z(2, 4, dtype=jnp.int32), {}, ValueError, "positions must broadcast"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(style="llama"), ValueError, "style"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(rotary_dim=7), ValueError, "even"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(rotary_dim=66), ValueError, r"\[2, D=64\]"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(rotary_dim=32.0), TypeError, "rotary_dim"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(theta=0.0), ValueError, "theta"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(scaling={"type": "yarn"}), ValueError, "yarn"),
        (_z(4, 2, 64), _z(4, dtype=jnp.int32), dict(scaling=[1]), TypeError, "scaling"),
        (
            _z(4, 2, 64),
            _z(4, dtype=jnp.int32),
            dict(scaling={"type": "llama3", "factor": 8.0}),
            ValueError,
            "missing",
        ),
        (
            _z(4, 2, 64),
            _z(4, dtype=jnp.int32),
            dict(scaling={**LLAMA3, "high_freq_factor": 0.5}),
            ValueError,
            "high_freq_factor",
        ),
        (
            _z(4, 2, 64),
            _z(4, dtype=jnp.int32),
            dict(scaling={"type": "linear", "factor": -2.0}),
            ValueError,
            "factor",
        ),
        (
            _z(4, 2, 64),
            _z(4, dtype=jnp.int32),
            dict(implementation="triton"),
            ValueError,
            "implementation",
        ),
    ],
)
def test_errors(x, positions, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        apply_rope(x, positions, **kwargs)
