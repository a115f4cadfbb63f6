"""paged_attention with chunk-sized queries (Sq of 64 and more: chunked prefill against the
paged cache), against the reference. On a Hopper GPU (compute capability 9.0, sm_90a build)
the default launch takes these on the Hopper prefill kernel, its keys read through the block
tables by TMA (policy::paged_hopper_takes, kPagedHopperMinSq); elsewhere, and for page sizes its
key boxes do not fit, on the paged decode kernels. Every case runs on the CPU kernel too."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged import _check, make_cache

from _util import randn


@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 128, 256])
def test_page_sizes(platform, rng, page_size):
    # 48: a page the Hopper kernel's 128-key boxes do not fit (the decode kernels take it).
    sq = 130
    lens = [sq, sq + 37, 700 + sq]
    kp, vp, bt, kl = make_cache(rng, lens, page_size, 2, 128, jnp.bfloat16)
    q = randn(rng, (len(lens), sq, 8, 128), jnp.bfloat16)
    _check(platform, rng, q, kp, vp, bt, kl)


@pytest.mark.parametrize("d,dv", [(64, 64), (80, 80), (256, 256), (192, 128)])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_head_dims_and_dtypes(platform, rng, d, dv, dtype):
    sq = 64  # the smallest Sq the Hopper kernel takes
    lens = [sq + 200, sq + 5]
    kp, _, bt, kl = make_cache(rng, lens, 16, 2, d, dtype)
    _, vp, _, _ = make_cache(rng, lens, 16, 2, dv, dtype)
    vp = vp[: kp.shape[0]]
    q = randn(rng, (len(lens), sq, 6, d), dtype)
    _check(platform, rng, q, kp, vp, bt, kl)


@pytest.mark.parametrize(
    "opts",
    [
        {"causal": False},
        {"sliding_window": (100, 0)},
        {"causal": False, "sliding_window": (50, 20)},
        {"logits_soft_cap": 5.0},
        {"softmax_scale": 0.3},
    ],
    ids=str,
)
def test_options(platform, rng, opts):
    sq = 257  # three 128-row tiles, the last of one row
    lens = [sq + 300, sq]
    kp, vp, bt, kl = make_cache(rng, lens, 32, 2, 64, jnp.bfloat16)
    q = randn(rng, (len(lens), sq, 8, 64), jnp.bfloat16)
    _check(platform, rng, q, kp, vp, bt, kl, **opts)


def test_rows_seeing_no_key_and_bad_data(platform, rng):
    sq = 96
    # Sequence 0 has fewer keys than queries (its first rows see none: zeros); 1 is fine; 2 has
    # an invalid id among its pages, 3 a length past its pages, 4 a negative length: NaN rows.
    lens = [40, 300, 200, 150, 150]
    kp, vp, bt, kl = make_cache(rng, lens, 16, 2, 128, jnp.bfloat16)
    P = kp.shape[0]
    bt = bt.at[2, 3].set(P + 7)
    kl = kl.at[3].set(10**6).at[4].set(-1)
    q = randn(rng, (len(lens), sq, 4, 128), jnp.bfloat16)
    o, lse = _check(platform, rng, q, kp, vp, bt, kl)
    assert np.all(o[0, : sq - 40] == 0) and np.all(np.isneginf(lse[0, :, : sq - 40]))
    assert np.all(np.isfinite(o[:2])) and np.all(np.isnan(o[2:]))
