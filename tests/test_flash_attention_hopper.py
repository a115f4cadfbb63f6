"""Tile edges of the prefill kernels' 128-row (and 192-row) query tiles and 64/96/128-row key
tiles (the Hopper kernel's, whose tiles are 64, 128, 192 and 256 wide; on other GPUs and on CPU
the same cases check the kernels there): lengths that are not multiples of the tiles,
Sq != Skv, windows crossing tiles, rows that see no key, packed sequences whose tiles reach into
the next sequence, non-finite values past a length, and head dims below the tile width
(zero-padded)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flash_attention import _dense_case, _varlen_case

import jax_flash
from jax_flash import reference

from _util import randn, rel_err, tolerance

# Cases that exist for the Hopper kernel's tiling and scheduling alone (CPU kernel: tens of
# seconds each on CI's two cores, its packed and long cases covered by the other tests here).
_TILING_ONLY = "a Hopper tiling / scheduling case; the CPU kernel's are covered by the others"


def _cpu_runs_only(platform, keep: bool):
    """Skips a tiling case's parametrisation on the CPU kernel, which has no such tiles (each
    tens of seconds of CI's two cores), unless `keep`: those kept still check the kernel."""
    if platform.name == "cpu" and not keep:
        pytest.skip(_TILING_ONLY)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_lengths_off_the_tiles(platform, rng, d, causal, dtype):
    _dense_case(platform, rng, 1, 200, 200, 6, 2, d, dtype, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,skv", [(130, 300), (300, 130), (129, 129), (1, 257)])
def test_unequal_lengths_across_tiles(platform, rng, sq, skv, causal):
    o, lse = _dense_case(platform, rng, 1, sq, skv, 4, 1, 128, "bfloat16", causal=causal)
    if causal and sq > skv:  # bottom-right: the first sq - skv rows see no key
        assert np.all(o[:, : sq - skv] == 0)
        assert np.all(np.isneginf(lse[:, :, : sq - skv]))


@pytest.mark.parametrize("window", [(100, 0), (150, 20), (0, 130), (1, 1)], ids=str)
@pytest.mark.parametrize("d", [64, 192, 256])
def test_windows_crossing_tiles(platform, rng, window, d):
    _dense_case(platform, rng, 1, 333, 333, 4, 2, d, "bfloat16", sliding_window=window)


def test_soft_cap_across_tiles(platform, rng):
    _dense_case(platform, rng, 1, 259, 259, 4, 2, 128, "float16", causal=True, logits_soft_cap=5.0)


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_tiles_into_next_sequence(platform, rng, causal, d):
    # 130 and 257 rows end inside a tile whose other rows belong to the next sequence.
    _cpu_runs_only(platform, (causal, d) == (True, 128))
    q_lens = [130, 1, 257, 0, 64, 129]
    k_lens = [200, 129, 257, 5, 64, 3]
    _varlen_case(platform, rng, q_lens, k_lens, 4, 2, d, "bfloat16", tail=3, causal=causal)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_values_past_a_length_never_reach_the_output(platform, rng, bad, d):
    # kv_seqlens 70 and 150 end inside a key tile; every k and v row past them is non-finite.
    B, S, Hq, Hkv = 2, 256, 4, 2
    dtype = jnp.bfloat16
    q, k, v = (randn(rng, (B, S, h, d), dtype) for h in (Hq, Hkv, Hkv))
    kv_lens = np.array([70, 150], np.int32)
    past = np.arange(S)[None, :, None, None] >= kv_lens[:, None, None, None]
    k_bad, v_bad = (jnp.where(past, jnp.asarray(bad, dtype), x) for x in (k, v))
    fn = functools.partial(jax_flash.flash_attention, implementation=platform.name)
    o = jax.jit(fn)(*platform.put(q, k_bad, v_bad), kv_seqlens=platform.put(jnp.asarray(kv_lens)))
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(x, cpu) for x in (q, k, v))
    lens = jnp.asarray(kv_lens)
    ref_o = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), kv_seqlens=lens)
    same = reference.attention(q, k, v, kv_seqlens=lens, compute_dtype=dtype)
    tol = tolerance(dtype, rel_err(same, ref_o))
    err = rel_err(o, ref_o)
    assert err <= tol, f"relative error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "d,dv",
    [
        (16, 16),
        (48, 32),
        (80, 80),
        (96, 96),
        (112, 112),
        (144, 144),
        (160, 160),
        (192, 128),
        (128, 192),
        (128, 64),
        (96, 64),
        (64, 112),
    ],
)
def test_head_dims_below_the_tile_width(platform, rng, d, dv, causal):
    # Zero-padded to the 64/128/192/256-wide tile (TMA reads zeros past D and Dv; at 128/192 a
    # whole Q / K panel of the 192 tile), or on the 128 tile computing 80 / 96 / 112 columns
    # (D or Dv below that width too: 96/64, 64/112); off the row tiles, GQA. Only the Dv columns
    # of each head may be written: a padded column stored would land in the next head's output.
    _cpu_runs_only(platform, (d, dv) in ((16, 16), (48, 32), (192, 128), (64, 112)))
    _dense_case(platform, rng, 2, 139, 201, 6, 2, d, "bfloat16", Dv=dv, causal=causal)


@pytest.mark.parametrize("d", [80, 160, 176])
def test_head_dims_below_the_tile_width_varlen(platform, rng, d):
    # Rows that see no key in a padded tile (o written as zeros, only D columns), packed
    # sequences reaching into the next one.
    _cpu_runs_only(platform, d == 80)
    q_lens, k_lens = [130, 0, 257, 64], [200, 5, 257, 0]
    _varlen_case(platform, rng, q_lens, k_lens, 4, 2, d, "bfloat16", tail=3, causal=True)


def test_rows_seeing_no_key_in_a_tile(platform, rng):
    # Causal with Sq - Skv = 250: the first 250 rows (whole 128-row tiles) see no key.
    o, lse = _dense_case(platform, rng, 1, 400, 150, 2, 1, 64, "float16", causal=True)
    assert np.all(o[:, :250] == 0) and np.all(np.isneginf(lse[:, :, :250]))


@pytest.mark.parametrize("sq,skv", [(1601, 1601), (1700, 1543), (1543, 1700)])
def test_tall_tiles_causal(platform, rng, sq, skv):
    # On Hopper, D 64 calls take 192-row query tiles (three consumer warpgroups) when not masked
    # or causal with max_seqlen_q >= 1536 (policy::flash_hopper_consumers), 96-key tiles when
    # causal (policy::flash_hopper_causal_tile): lengths off those tiles, Sq != Skv (the first
    # sq - skv rows see no key).
    o, lse = _dense_case(platform, rng, 1, sq, skv, 4, 2, 64, "bfloat16", causal=True)
    if sq > skv:
        assert np.all(o[:, : sq - skv] == 0)
        assert np.all(np.isneginf(lse[:, :, : sq - skv]))


@pytest.mark.parametrize(
    "d,dv,causal",
    [(80, 80, True), (80, 80, False), (96, 96, True), (96, 64, False), (64, 80, True)],
)
def test_tall_narrow_tiles(platform, rng, d, dv, causal):
    # On Hopper, the 128 tile computing 80 / 96 columns takes 192 x 96 tiles (three consumer
    # warpgroups) from max_seqlen_q 3072 / 2048 (policy::flash_hopper_consumers): lengths off
    # those tiles, Sq != Skv, D != Dv.
    _cpu_runs_only(platform, (d, dv, causal) == (96, 64, False))
    _dense_case(platform, rng, 1, 3100, 3001, 2, 1, d, "bfloat16", Dv=dv, causal=causal)


def test_tall_narrow_tiles_varlen(platform, rng):
    # Packed sequences on the 192 x 96 tiles of the 96 tile (max_seqlen_q 2100), tiles reaching
    # into the next sequence, an empty one.
    _cpu_runs_only(platform, keep=False)
    q_lens, k_lens = [2100, 0, 130, 1], [2050, 9, 200, 129]
    _varlen_case(platform, rng, q_lens, k_lens, 2, 1, 96, "float16", tail=3, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_tall_tiles_varlen(platform, rng, causal):
    # 192-row tiles reaching into the next packed sequence; max_seqlen_q 1601 takes them causal too.
    _cpu_runs_only(platform, keep=False)
    q_lens = [1601, 1, 0, 193, 384, 130]
    k_lens = [1601, 129, 7, 193, 500, 3]
    _varlen_case(platform, rng, q_lens, k_lens, 4, 2, 64, "float16", tail=3, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_tall_tiles_dynamic_items(platform, rng, causal):
    # With more 192-row work items than SMs, the Hopper kernel's CTAs take items from a counter
    # in whatever order they free up (policy::flash_hopper_dynamic_items): packed sequences of
    # mixed lengths, empty ones among them (29 query tiles x 16 heads: 464 items), and 3 x 1601
    # dense (432 items). Each item is computed the same way whichever CTA takes it, so two runs
    # agree bit for bit.
    _cpu_runs_only(platform, keep=False)
    q_lens = [1601, 0, 777, 1, 1536, 64, 0, 900]
    k_lens = [1601, 3, 777, 129, 1536, 64, 0, 1000]
    _varlen_case(platform, rng, q_lens, k_lens, 16, 4, 64, "bfloat16", causal=causal)
    _dense_case(platform, rng, 3, 1601, 1601, 16, 4, 64, "bfloat16", causal=causal)
    q, k, v = (randn(rng, (3, 1601, h, 64), jnp.bfloat16) for h in (16, 4, 4))
    fn = jax.jit(
        functools.partial(
            jax_flash.flash_attention, causal=causal, return_lse=True,
            implementation=platform.name,
        )
    )  # fmt: skip
    args = platform.put(q, k, v)
    first, again = fn(*args), fn(*args)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
