"""Tile edges of the Hopper backward (128-key blocks, or 64 on the 256-wide tile; 64-row query
blocks; 2- and 3-visit load rings) through the backward's FFI target, against jax.vjp of the
float32 reference.

Every case runs with both backward kernels of a Hopper build, picked by the call's launch
options (FlashBwdLaunch.hopper_kernel): "hopper", on a compute capability 9.0 GPU with an sm_90a
build, runs the Hopper kernels (float16 / bfloat16, head dims multiples of 16 up to 256,
zero-padded to a 64-, 128- or 256-wide tile: hopper/flash_bwd_kernel.cuh for the first two,
hopper/flash_bwd_wide_kernel.cuh for the last), and the mma.sync kernel (or, for the padded
head dims, the SIMT kernel) elsewhere; "mma" runs those. Lengths off both
tiles, Sq != Skv both ways, GQA groups 1 / 4 / 8 (a CTA walks every query head of its kv
head), causal / window / soft cap, zero-length and unowned rows (zeros), packed sequences whose
tiles reach into the next one, non-finite values in rows no sequence owns, and the deterministic
mode's bit-identical reruns. GPU only.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CUDA_SKIP
from test_flash_bwd_cuda import _bwd, _check, _check_deterministic, _tolerance

from jax_flash.primitives.flash_attention import BWD_HOPPER_KERNELS, FlashBwdLaunch

from _util import rel_err

pytestmark = pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP))


@pytest.fixture(params=BWD_HOPPER_KERNELS)
def launch(request):
    # strict: a Hopper call whose TMA descriptors the driver rejects fails here instead of
    # passing on the mma.sync kernel
    return FlashBwdLaunch(hopper_kernel=request.param, strict=True)


def _check_on(launch, *args, **kwargs):
    return _check(*args, launch=launch, **kwargs)


MASKS = [
    # name, window_left, window_right, softcap
    ("full", -1, -1, 0.0),
    ("causal", -1, 0, 0.0),
    ("window", 150, 20, 0.0),
    ("softcap", -1, -1, 5.0),
]


def _cfg(d, mask):
    _, left, right, cap = mask
    return dict(softmax_scale=1.0 / np.sqrt(d), softcap=cap, window_left=left, window_right=right)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", MASKS, ids=[m[0] for m in MASKS])
def test_lengths_off_the_tiles(rng, launch, dtype, d, mask):
    # 129 / 257 keys end one past a 128-key block; 65 / 191 queries one past / one short of a
    # 64-row block; more visits than the 3-stage load ring.
    _check_on(launch, rng, jnp.dtype(dtype), [191, 65], [257, 129], 4, 2, d, d, _cfg(d, mask))


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("mask", MASKS[:2], ids=[m[0] for m in MASKS[:2]])
def test_gqa_groups(rng, launch, group, mask):
    # Every query head of a kv head visits the CTA's keys; dK/dV sum over them in registers.
    _check_on(
        launch, rng, jnp.dtype("bfloat16"), [300], [300], 2 * group, 2, 128, 128, _cfg(128, mask)
    )


@pytest.mark.parametrize(
    "d,dv",
    [(32, 32), (48, 48), (80, 80), (96, 96), (112, 112), (128, 64), (64, 112)]
    + [(160, 160), (192, 192), (192, 128), (144, 240)],  # the 256-wide tile
)
@pytest.mark.parametrize("mask", MASKS[:2], ids=[m[0] for m in MASKS[:2]])
def test_head_dims_below_the_tile_width(rng, launch, d, dv, mask):
    # Zero-padded to the 64/128/256-wide tile (TMA reads zeros past D and Dv): only the D columns of
    # dq / dk and the Dv columns of dv may be written (a padded column would land in the next
    # head's gradient); lengths off both tiles, GQA.
    _check_on(launch, rng, jnp.dtype("bfloat16"), [191, 65], [257, 129], 4, 2, d, dv, _cfg(d, mask))


@pytest.mark.parametrize("sq,skv", [(1, 300), (300, 1), (64, 128), (128, 64), (333, 129)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_unequal_lengths(rng, launch, sq, skv, d):
    # Causal, bottom-right: with sq > skv the first sq - skv rows see no key (zero gradients).
    _check_on(launch, rng, jnp.dtype("bfloat16"), [sq], [skv], 4, 1, d, d, _cfg(d, MASKS[1]))


@pytest.mark.parametrize("window", [(0, 0), (1, 1), (127, 0), (0, 200)], ids=str)
def test_windows_across_blocks(rng, launch, window):
    mask = ("w", window[0], window[1], 0.0)
    _check_on(launch, rng, jnp.dtype("float16"), [333], [333], 4, 2, 64, 64, _cfg(64, mask))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", MASKS[:2], ids=[m[0] for m in MASKS[:2]])
def test_varlen_tiles_into_next_sequence(rng, launch, d, mask):
    # No gap: 130 / 257 queries and 200 / 129 keys end inside tiles whose other rows belong to
    # the next sequence (TMA reads them; they must not count). Zero-length sequences too.
    lens_q = [130, 1, 257, 0, 64, 129]
    lens_k = [200, 129, 257, 5, 64, 3]
    _check_on(launch, rng, jnp.dtype("bfloat16"), lens_q, lens_k, 4, 2, d, d, _cfg(d, mask))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_unowned_rows_and_empty_sequences(rng, launch, d):
    # 5 unowned rows after each sequence (written as zeros), a sequence with no queries and one
    # with no keys.
    lens_q, lens_k = [97, 0, 200, 7], [203, 9, 77, 0]
    _check_on(
        launch, rng, jnp.dtype("float16"), lens_q, lens_k, 6, 2, d, d, _cfg(d, MASKS[1]), gap=5
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_non_finite_unowned_rows_never_reach_the_outputs(rng, launch, bad, d):
    # Rows no sequence owns sit inside the tiles TMA reads; poisoned, they must change nothing.
    args = _check_on(
        launch, rng, jnp.dtype("bfloat16"), [70, 150], [100, 45], 4, 2, d, d, _cfg(d, MASKS[0]),
        gap=6,
    )  # fmt: skip
    q, k, v, o, lse, do, dlse, starts, cfg, got = args
    owned_q = np.zeros(q.shape[0], bool)
    owned_k = np.zeros(k.shape[0], bool)
    for a, b in zip(starts[0], starts[1], strict=True):
        owned_q[a:b] = True
    for a, b in zip(starts[2], starts[3], strict=True):
        owned_k[a:b] = True

    def poison(x, owned):
        x = np.asarray(x).copy()
        x[~owned] = bad
        return jnp.asarray(x)

    again = _bwd(
        poison(q, owned_q),
        poison(k, owned_k),
        poison(v, owned_k),
        poison(o, owned_q),
        lse,
        poison(do, owned_q),
        dlse,
        starts,
        cfg,
        False,
        launch,
    )
    for name, a, b in zip(("dq", "dk", "dv"), again, got, strict=True):
        a = np.asarray(a, np.float32)
        assert np.all(np.isfinite(a)), name
        assert rel_err(a, b) <= _tolerance(jnp.bfloat16), name


@pytest.mark.parametrize("d", [64, 80, 128, 160, 256])
@pytest.mark.parametrize("mask", [MASKS[0], MASKS[3]], ids=["full", "softcap"])
def test_deterministic_bit_identical(rng, launch, d, mask):
    # Several key blocks add to each query block's dQ (in a fixed order), GQA group 4; 80 and
    # 160: the padded variants of the 128- and 256-wide tiles.
    args = _check_on(
        launch, rng, jnp.dtype("bfloat16"), [400, 77], [520, 300], 8, 2, d, d, _cfg(d, mask)
    )
    _check_deterministic(args, reruns=2, launch=launch)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_both_kernels_agree(rng, d):
    # The same inputs through the Hopper kernel (where the device and build have it) and the
    # mma.sync kernel: each matches the reference (in _check) and the two match each other.
    *inputs, got_hopper = _check_on(
        FlashBwdLaunch("hopper", strict=True),
        rng, jnp.dtype("bfloat16"), [150, 70], [200, 90], 4, 2, d, d, _cfg(d, MASKS[1]),
    )  # fmt: skip
    got_mma = _bwd(*inputs, False, FlashBwdLaunch("mma"))
    for name, a, b in zip(("dq", "dk", "dv"), got_mma, got_hopper, strict=True):
        assert rel_err(a, b) <= _tolerance(jnp.bfloat16), name
