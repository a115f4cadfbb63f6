"""jax_flash demo: fused attention on the default device, checked against the jnp reference.

    python examples/demo.py [--batch 2] [--seqlen 1024] [--heads 16 4] [--head-dim 128]

Runs `jax_flash.flash_attention` (causal, GQA, bf16 on GPU / float32 on CPU) and
`jax_flash.flash_attention_varlen` on packed prompts, prints the relative error against
`jax_flash.reference` and the median time of a jitted call beside the jnp reference's.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


def median_ms(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 4), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(
        f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; "
        f"jax_flash {jax_flash.__version__} (CUDA kernels built: {jax_flash.has_cuda_kernels()})"
    )

    B, S, (Hq, Hkv), D = args.batch, args.seqlen, args.heads, args.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, S, Hq, D), dtype)
    k = jax.random.normal(kk, (B, S, Hkv, D), dtype)
    v = jax.random.normal(kv, (B, S, Hkv, D), dtype)

    flash = jax.jit(functools.partial(jax_flash.flash_attention, causal=True))
    ref = jax.jit(functools.partial(jax_flash.flash_attention, causal=True, implementation="xla"))
    out = flash(q, k, v)
    expected = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
    t_flash, t_ref = median_ms(flash, q, k, v), median_ms(ref, q, k, v)
    flops = 2 * B * Hq * S * S * D  # causal: half of 4*B*H*S^2*D
    print(f"\nflash_attention  {jnp.dtype(dtype).name} B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} causal")
    print(f"  relative error vs float32 reference: {rel_err(out, expected):.2e}")
    print(
        f"  jax_flash     {t_flash:9.3f} ms  {flops / t_flash / 1e9:9.1f} TFLOP/s"
        if on_gpu
        else f"  jax_flash     {t_flash:9.3f} ms  {flops / t_flash / 1e6:9.2f} GFLOP/s"
    )
    print(f"  jnp reference {t_ref:9.3f} ms  ({t_ref / t_flash:.1f}x the time of jax_flash)")

    # Packed prompts of different lengths: no padding compute.
    lens = np.array([S // 3, 1, S // 2 + 7, S // 5], np.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    T = int(lens.sum())
    qp = jax.random.normal(kq, (T, Hq, D), dtype)
    kp = jax.random.normal(kk, (T, Hkv, D), dtype)
    vp = jax.random.normal(kv, (T, Hkv, D), dtype)
    varlen = jax.jit(functools.partial(jax_flash.flash_attention_varlen, causal=True))
    out = varlen(qp, kp, vp, cu, cu)
    f32 = [x.astype(jnp.float32) for x in (qp, kp, vp)]
    expected = jax_flash.flash_attention_varlen(*f32, cu, cu, causal=True, implementation="xla")
    print(f"\nflash_attention_varlen  prompts of lengths {lens.tolist()} (packed T={T})")
    print(f"  relative error vs float32 reference: {rel_err(out, expected):.2e}")
    print(f"  jax_flash     {median_ms(varlen, qp, kp, vp, cu, cu):9.3f} ms")


if __name__ == "__main__":
    main()
