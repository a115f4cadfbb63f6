"""The decisions and limits of the CUDA kernels have one home, C++ (cuda/include/jax_flash/
policy/*.h), which the `_cpu` module's `policy` submodule exposes: the Python layers must use
those values, and the split heuristic must give the split counts measured best on an H100."""

import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _native
from jax_flash.ops import paged_attention as paged_ops
from jax_flash.primitives import flash_attention as flash_prim
from jax_flash.primitives import kv_cache as kv_prim
from jax_flash.primitives import paged_attention as paged_prim

policy = _native._cpu.policy
H100_SMS = 132


def test_python_uses_the_cpp_values():
    assert paged_prim.policy is policy
    assert flash_prim.CUDA_MAX_HEAD_DIM == policy.FLASH_MAX_HEAD_DIM == 256
    assert kv_prim.MAX_QUANT_ROW_BYTES == policy.ROPE_MAX_QUANT_ROW_BYTES == 5888
    assert policy.PAGED_HEAD_DIMS == (64, 128, 256)
    assert policy.PAGED_KERNELS == {"auto": 0, "cuda_core": 1, "tensor_core": 2}
    for d in range(1, 300):
        assert policy.paged_head_dim_supported(d, d) == (d in policy.PAGED_HEAD_DIMS)
    assert not policy.paged_head_dim_supported(128, 64)


# bf16, Hq = 32, Hkv = 8 (GQA-4), D = 128, one query token: (batch, context) -> the split count
# measured best on an H100 SXM (policy/paged.h, jax_flash.ops.paged_attention.default_num_splits)
# with the CUDA-core kernel's 4-row CTAs, which float32 q runs (q_bytes 4 below).
MEASURED_BEST = {(1, 4096): 32, (1, 32768): 32, (1, 131072): 32, (2, 16384): 16, (4, 16384): 8,
                 (8, 8192): 4, (16, 4096): 2, (32, 4096): 1, (64, 8192): 1}  # fmt: skip


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("batch,ctx", list(MEASURED_BEST))
def test_split_heuristic_measured_best(batch, ctx, mma):
    # Both kernels fit 2 CTAs of this group per SM at D = 128: the same split counts.
    got = policy.paged_num_splits(batch, 8, 4, 1, ctx, H100_SMS, 128, mma, 2, 4)
    assert got == MEASURED_BEST[batch, ctx]


def test_split_heuristic_edges():
    assert policy.paged_num_splits(0, 8, 4, 1, 4096, H100_SMS, 128, False, 2, 4) == 1  # B = 0
    assert policy.paged_num_splits(1, 8, 4, 1, 0, H100_SMS, 128, False, 2, 4) == 1  # no keys
    assert policy.paged_num_splits(1, 8, 4, 1, 300, H100_SMS, 128, False, 2, 4) == 2  # 128 keys
    # 16 query rows per kv head: one CUDA-core CTA per SM, but still 2 tensor-core CTAs
    assert policy.paged_num_splits(1, 8, 4, 4, 32768, H100_SMS, 128, False, 2, 4) == 16
    assert policy.paged_num_splits(1, 8, 4, 4, 32768, H100_SMS, 128, True, 2, 2) == 32
    # 16-bit q on the CUDA-core kernel: 16-row CTAs (one per SM) whatever the group
    assert policy.paged_num_splits(1, 8, 4, 1, 32768, H100_SMS, 128, False, 2, 2) == 16
    # 8-bit caches at D = 64: 3 tensor-core CTAs per SM
    assert [policy.paged_mma_ctas_per_sm(d, 2) for d in (64, 128, 256)] == [2, 2, 1]
    assert [policy.paged_mma_ctas_per_sm(d, 1) for d in (64, 128, 256)] == [3, 2, 1]
    assert [policy.paged_rows_per_cta(r, 4) for r in (1, 4, 5, 8, 9, 64)] == [4, 4, 8, 8, 16, 16]
    assert [policy.paged_rows_per_cta(r, 2) for r in (1, 4, 5, 8, 9, 64)] == [16] * 6


def test_default_num_splits_is_the_cpp_heuristic(monkeypatch):
    monkeypatch.setattr(paged_ops, "_sm_count", lambda: H100_SMS)
    cases = [(1, 8, 4, 1, 32768, 128, 2), (3, 2, 7, 3, 5000, 64, 1), (0, 8, 4, 1, 100, 256, 2),
             (40, 4, 1, 1, 64, 128, 2)]  # fmt: skip
    for b, hkv, g, sq, ctx, d, item in cases:
        for mma_ok in (False, True):
            for kernel, mma in (("auto", mma_ok), ("tensor_core", mma_ok), ("cuda_core", False)):
                for q_item in (2, 4):
                    got = paged_ops.default_num_splits(
                        b, hkv, g, sq, ctx, d, mma_ok, item, kernel, q_itemsize=q_item
                    )
                    want = (b, hkv, g, sq, ctx, H100_SMS, d, mma, item, q_item)
                    assert got == policy.paged_num_splits(*want)


# (q dtype, cache dtype, scale mode, D, Dv, pages, page size, Hkv) -> the tensor-core kernel
# takes it (paged_params.h: float16 / bfloat16 q with a cache of q's dtype or a scaled 8-bit one,
# D == Dv in 64 / 128 / 256, 1 to 2^32 - 1 cache rows).
MMA_CASES = [
    (("bfloat16", "bfloat16", 0, 128, 128, 10, 16, 2), True),
    (("float16", "float16", 0, 64, 64, 10, 16, 2), True),
    (("bfloat16", "int8", 1, 256, 256, 10, 16, 2), True),
    (("float16", "float8_e4m3fn", 2, 128, 128, 10, 16, 2), True),
    (("float32", "float32", 0, 128, 128, 10, 16, 2), False),
    (("float32", "int8", 1, 128, 128, 10, 16, 2), False),
    (("bfloat16", "float16", 0, 128, 128, 10, 16, 2), False),
    (("bfloat16", "bfloat16", 0, 96, 96, 10, 16, 2), True),
    (("bfloat16", "bfloat16", 0, 128, 64, 10, 16, 2), True),
    (("bfloat16", "bfloat16", 0, 128, 128, 0, 16, 2), False),
    (("bfloat16", "bfloat16", 0, 128, 128, 2**24, 16, 16), False),  # 2^32 rows
    (("bfloat16", "bfloat16", 0, 128, 128, 2**24, 16, 15), True),
    (("bfloat16", "bfloat16", 0, 40, 40, 10, 16, 2), False),  # not a multiple of 16
    (("float16", "int8", 1, 272, 272, 10, 16, 2), False),  # above 256
    (("bfloat16", "float8_e4m3fn", 2, 16, 208, 10, 16, 2), True),
]


def test_head_dim_rules():
    """The tensor-core kernels (paged decode and prefill) take D, Dv multiples of 16 up to 256
    on their 64 / 128 / 256 tiles; the paged CUDA-core kernel D == Dv in 64 / 128 / 256."""
    assert policy.PAGED_MMA_TILE_DIMS == (64, 128, 256)
    for d in range(1, 300):
        for dv in (d, 64, 128):
            ok = 16 <= d <= 256 and d % 16 == 0 and dv % 16 == 0
            assert policy.paged_mma_head_dims_supported(d, dv) == ok
            assert policy.flash_mma_head_dims_supported(d, dv) == ok
            if ok:
                tile = next(t for t in (64, 128, 256) if max(d, dv) <= t)
                assert policy.paged_mma_tile_dim(d, dv) == tile == policy.flash_mma_tile_dim(d, dv)


@pytest.mark.parametrize(
    "d,dv,tile",
    [
        (16, 16, 64),
        (64, 64, 64),
        (80, 64, 80),
        (80, 80, 80),
        (96, 96, 96),
        (64, 96, 96),
        (96, 112, 112),
        (112, 112, 112),
        (128, 128, 128),
        (144, 144, 192),
        (160, 160, 192),
        (192, 192, 192),
        (192, 128, 192),
        (128, 192, 192),
        (48, 176, 192),
        (208, 208, 256),
        (192, 208, 256),
        (256, 256, 256),
    ],
)
def test_hopper_prefill_tile(d, dv, tile):
    """The Hopper prefill kernel adds a 192-wide tile for max(D, Dv) in (128, 192] (D 192 and
    D/Dv 192/128 would otherwise run zero-padded on the 256 tile) and the 128 tile computing 80,
    96 or 112 columns for max(D, Dv) in (64, 112]; the mma.sync kernel keeps 64 / 128 / 256."""
    assert policy.flash_hopper_tile_dim(d, dv) == tile
    assert policy.flash_mma_tile_dim(d, dv) == next(t for t in (64, 128, 256) if tile <= t)


@pytest.mark.parametrize(
    "tile,softcap,window,max_seqlen_q,consumers",
    [
        (64, False, (-1, -1), 100, 3),
        (64, False, (-1, 0), 1535, 2),
        (64, False, (-1, 0), 1536, 3),
        (64, False, (-1, 5), 4096, 3),
        (64, False, (100, 0), 4096, 2),
        (64, True, (-1, -1), 4096, 2),
        (128, False, (-1, -1), 4096, 2),
        (112, False, (-1, -1), 16384, 2),
        (80, False, (-1, -1), 3071, 2),
        (80, False, (-1, -1), 3072, 3),
        (80, False, (-1, 0), 4096, 3),
        (80, True, (-1, 0), 4096, 2),
        (96, False, (-1, -1), 2047, 2),
        (96, False, (-1, 0), 2048, 3),
        (96, False, (64, 0), 4096, 2),
    ],
)
def test_hopper_prefill_consumers(tile, softcap, window, max_seqlen_q, consumers):
    """Three consumer warpgroups (192-row tiles) on the 64 tile, and on the 80 / 96 tiles for
    long calls; not for short causal calls on the 64 tile, sliding windows (taller tiles waste
    work on masked scores) or soft caps."""
    got = policy.flash_hopper_consumers(tile, softcap, *window, max_seqlen_q)
    assert got == consumers


@pytest.mark.parametrize(
    "tile,consumers,window_right,causal_tile",
    [(64, 3, 0, True), (64, 3, 7, True), (64, 3, -1, False), (64, 2, 0, False), (96, 3, 0, False)],
)
def test_hopper_prefill_causal_tile(tile, consumers, window_right, causal_tile):
    """The 64 tile's 3-consumer calls with a right-bounded mask take its 96-key variant."""
    assert policy.flash_hopper_causal_tile(tile, consumers, window_right) == causal_tile


PAGED = policy.PAGED_CHOICES
KERNEL = policy.PAGED_KERNELS


@pytest.mark.parametrize(
    "mma_ok,d,dv,kernel,expected",
    [
        (True, 128, 128, "auto", "tensor_core"),
        (True, 80, 80, "auto", "tensor_core"),
        (False, 128, 128, "auto", "cuda_core"),
        (False, 80, 80, "auto", "none"),
        (True, 128, 128, "cuda_core", "cuda_core"),
        (True, 80, 80, "cuda_core", "none"),
        (True, 192, 128, "tensor_core", "tensor_core"),
        (False, 128, 128, "tensor_core", "none"),
    ],
)
def test_paged_kernel_choice(mma_ok, d, dv, kernel, expected):
    assert policy.paged_kernel_choice(mma_ok, d, dv, KERNEL[kernel]) == PAGED[expected]
    assert policy.paged_use_mma(mma_ok, KERNEL[kernel]) == (mma_ok and kernel != "cuda_core")


@pytest.mark.parametrize(
    "dtype,d,dv,scale,cap,expected",
    [
        ("bfloat16", 128, 128, 0.1, 0.0, "tensor_core"),
        ("float16", 80, 80, 0.1, 0.0, "tensor_core"),
        ("bfloat16", 192, 128, 0.1, 0.0, "tensor_core"),
        ("bfloat16", 40, 40, 0.1, 0.0, "simt"),
        ("float32", 128, 128, 0.1, 0.0, "simt"),
        ("bfloat16", 128, 128, -1.0, 0.0, "simt"),  # the mma kernel keeps an unscaled max
        ("bfloat16", 128, 128, -1.0, 5.0, "tensor_core"),
        ("bfloat16", 128, 128, float("inf"), 0.0, "simt"),
        ("bfloat16", 320, 320, 0.1, 0.0, "none"),
        ("float32", 64, 288, 0.1, 0.0, "none"),
    ],
)
def test_flash_kernel_choice(dtype, d, dv, scale, cap, expected):
    assert policy.flash_kernel_choice(dtype, d, dv, scale, cap) == policy.FLASH_CHOICES[expected]


@pytest.mark.parametrize("args,expected", MMA_CASES)
def test_tensor_core_rule(args, expected):
    assert policy.paged_mma_supported(*args) == expected
    assert policy.paged_use_mma(expected, policy.PAGED_KERNELS["auto"]) == expected
    assert not policy.paged_use_mma(expected, policy.PAGED_KERNELS["cuda_core"])


# (the op refuses an unquantized cache of another dtype than q's, whatever the kernel)
@pytest.mark.parametrize("args,expected", MMA_CASES[:6] + MMA_CASES[7:9])
def test_ops_route_by_the_rule(monkeypatch, args, expected):
    """paged_attention picks its split count for the kernel the rule routes to, and asking for
    the tensor-core kernel where the rule says no raises."""
    dt, cdt, mode, D, Dv, P, page, Hkv = args
    seen = []
    monkeypatch.setattr(paged_ops, "default_num_splits", lambda *a, **k: seen.append(k) or 1)
    q = jnp.zeros((2, 4 * Hkv, D), dt)
    kp = jnp.zeros((P, page, Hkv, D), cdt)
    vp = jnp.zeros((P, page, Hkv, Dv), cdt)
    scales = {}
    if mode:
        shape = (Hkv,) if mode == 1 else (P, page, Hkv)
        scales = {"k_scale": jnp.ones(shape, jnp.float32), "v_scale": jnp.ones(shape, jnp.float32)}
    bt, kl = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    jax_flash.paged_attention(q, kp, vp, bt, kl, implementation="xla", **scales)
    assert seen[-1]["mma_ok"] == expected
    launch = paged_prim.PagedLaunch(kernel="tensor_core")
    if expected:
        jax_flash.paged_attention(q, kp, vp, bt, kl, implementation="xla", _launch=launch, **scales)
        assert seen[-1]["kernel"] == "tensor_core"
    else:
        with pytest.raises(ValueError, match="tensor-core kernel was asked for"):
            jax_flash.paged_attention(q, kp, vp, bt, kl, _launch=launch, **scales)


def test_launch_defaults_from_the_environment(monkeypatch):
    read = paged_prim.default_launch.__wrapped__
    monkeypatch.delenv("JAX_FLASH_PAGED_MMA", raising=False)
    monkeypatch.delenv("JAX_FLASH_PAGED_PDL", raising=False)
    assert read() == paged_prim.PagedLaunch("auto", pdl=True, merge_pdl=True)
    monkeypatch.setenv("JAX_FLASH_PAGED_MMA", "0")
    monkeypatch.setenv("JAX_FLASH_PAGED_PDL", "0")
    assert read() == paged_prim.PagedLaunch("cuda_core", pdl=False)
    monkeypatch.setenv("JAX_FLASH_PAGED_MMA", "1")
    assert read().kernel == "auto"
    config = paged_prim.PagedConfig(1.0, 0.0, -1, 0, 1, 0, None, read())
    attrs = paged_prim._attrs(config)
    assert (attrs["kernel"], attrs["pdl"], attrs["merge_pdl"]) == (0, 0, 1)
    attrs = paged_prim._attrs(paged_prim.PagedConfig(1.0, 0.0, -1, 0, 1, 0, None))
    assert attrs["kernel"] == policy.PAGED_KERNELS[paged_prim.default_launch().kernel]
