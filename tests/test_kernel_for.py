"""jax_flash.kernel_for tells which kernel a call runs (the lowering's own decision), and a call
that no native kernel takes warns once (NativeFallbackWarning) under implementation=None."""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.primitives import _common
from jax_flash.primitives.paged_attention import PagedLaunch

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _paged(d, dv, dtype=BF16, cache=None, scales=None, **kw):
    cache = dtype if cache is None else cache
    args = (S((3, 8, d), dtype), S((9, 16, 2, d), cache), S((9, 16, 2, dv), cache),
            S((3, 3), jnp.int32), S((3,), jnp.int32))  # fmt: skip
    if scales is not None:
        kw.update(k_scale=S(scales, F32), v_scale=S(scales, F32))
    return functools.partial(jax_flash.paged_attention, **kw), args


def _prefill(d, dv, dtype=BF16, **kw):
    args = (S((2, 5, 4, d), dtype), S((2, 9, 2, d), dtype), S((2, 9, 2, dv), dtype))
    return functools.partial(jax_flash.flash_attention, **kw), args


CUDA_CASES = [
    (_paged(128, 128), "cuda:tensor_core"),
    (_paged(80, 80), "cuda:tensor_core"),
    (_paged(16, 16, F16), "cuda:tensor_core"),
    (_paged(192, 128), "cuda:tensor_core"),
    (_paged(96, 96, F16, jnp.int8, (2,)), "cuda:tensor_core"),
    (_paged(112, 112, BF16, jnp.float8_e4m3fn, (9, 16, 2)), "cuda:tensor_core"),
    (_paged(128, 128, F32), "cuda:cuda_core"),
    (_paged(96, 96, F32), "xla reference"),
    (_paged(40, 40), "xla reference"),
    (_paged(128, 128, _launch=PagedLaunch("cuda_core")), "cuda:cuda_core"),
    (_paged(80, 80, _launch=PagedLaunch("cuda_core")), "xla reference"),
    (_paged(128, 128, implementation="xla"), "xla reference"),
    (_prefill(128, 128), "cuda:tensor_core"),
    (_prefill(80, 80, F16), "cuda:tensor_core"),
    (_prefill(192, 128), "cuda:tensor_core"),
    (_prefill(40, 40), "cuda:simt"),
    (_prefill(80, 80, F32), "cuda:simt"),
    (_prefill(320, 320), "xla reference"),
    (_prefill(64, 64, implementation="xla"), "xla reference"),
]


@pytest.mark.parametrize("case,expected", CUDA_CASES, ids=lambda x: x if isinstance(x, str) else "")
def test_cuda_kernel_of_a_call(case, expected):
    fn, args = case
    assert jax_flash.kernel_for(fn, *args, platform="cuda") == expected
    assert jax_flash.kernel_for(fn, *args, platform="gpu") == expected


def test_cpu_and_other_platforms():
    fn, args = _paged(80, 80)
    assert jax_flash.kernel_for(fn, *args, platform="cpu") == "cpu"
    assert jax_flash.kernel_for(fn, *args, platform="rocm") == "xla reference"
    fn, args = _prefill(40, 40)
    assert jax_flash.kernel_for(fn, *args, platform="cpu") == "cpu"
    k, pos = S((4, 3, 2, 64), BF16), S((4, 3), jnp.int32)
    assert jax_flash.kernel_for(jax_flash.apply_rope, k, pos, platform="cuda") == "cuda"
    fn, args = _paged(64, 64, implementation="cpu")
    with pytest.raises(ValueError, match="implementation='cpu' was asked for"):
        jax_flash.kernel_for(fn, *args, platform="cuda")


def test_several_primitives_in_order():
    def step(q, k, v):
        o = jax_flash.flash_attention(q, k, v, causal=True)
        return jax_flash.flash_attention(o.astype(F32), k.astype(F32), v.astype(F32))

    args = (S((1, 5, 2, 64), BF16),) * 3
    assert jax_flash.kernel_for(step, *args, platform="cuda") == "cuda:tensor_core, cuda:simt"
    assert jax_flash.kernel_for(jax.jit(step), *args, platform="cuda") == (
        "cuda:tensor_core, cuda:simt"
    )


def test_fallback_warns_once_per_case(monkeypatch):
    """Lowered for a platform without jax_flash kernels, every op runs the jnp reference: it
    warns once per op and reason (the CUDA fallback of head dims goes the same way: see
    test_flash_attention.test_cuda_lowering_without_gpu)."""
    monkeypatch.setattr(_common, "_WARNED", set())
    q = jnp.zeros((1, 7, 2, 64), F32)

    def lower(x):
        return jax.jit(jax_flash.flash_attention).trace(x, x, x).lower(lowering_platforms=("rocm",))

    with pytest.warns(jax_flash.NativeFallbackWarning, match="flash_attention.*'rocm'"):
        lower(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lower(jnp.zeros((1, 9, 2, 64), F32))  # the same case: no second warning
    assert len(_common._WARNED) == 1
