"""Head dims beside D 128 on one GPU, one process: paged decode (64 x 8k, 8 x 8k, 1 x 32k and
1 x 8k, bf16 32/8, page 16; D == Dv and D != Dv) and prefill (B4 S4k bf16 32/8, causal and
full), with the kernel each call runs (`jax_flash.kernel_for`). The benchmark grids hold D == Dv
only; this covers the D != Dv shapes (192/128, 128/64) and the narrow head dims.

Decode GB/s counts K (D) and V (Dv) bytes read; prefill TFLOP/s counts 2 (D + Dv) S^2 per head
(half of it causal). Times are per call in a jitted loop (`jax_flash.bench.timing`).

    python tools/gpu/head_dim_bench.py [--decode-only] [OUT_DIR]   # writes OUT_DIR/head_dims.json
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import timing

DECODE_DIMS = (
    (128, 128),
    (192, 128),
    (128, 64),
    (256, 256),
    (160, 160),
    (96, 96),
    (80, 80),
    (112, 112),
)
PREFILL_DIMS = (
    (128, 128),
    (192, 128),
    (80, 80),
    (96, 96),
    (112, 112),
    (160, 160),
    (192, 192),
    (64, 64),
    (256, 256),
)


def _kernel(op, *args, **kw):
    try:
        return jax_flash.kernel_for(op, *args, platform="cuda", **kw)
    except Exception as e:  # a build without the CUDA kernels
        return f"? {e}"[:80]


def decode_row(key, batch, ctx, d, dv, heads=(32, 8), page=16):
    hq, hk = heads
    npg = ctx // page
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (batch, hq, d), jnp.bfloat16)
    kp = jax.random.normal(ks[1], (batch * npg, page, hk, d), jnp.bfloat16)
    vp = jax.random.normal(ks[2], (batch * npg, page, hk, dv), jnp.bfloat16)
    bt = jax.random.permutation(ks[3], batch * npg).astype(jnp.int32).reshape(batch, npg)
    kl = jnp.full((batch,), ctx, jnp.int32)
    args = (q, kp, vp, bt, kl)
    row = {"kernel": _kernel(jax_flash.paged_attention, *args)}
    t, _ = timing.auto_loop_time(jax_flash.paged_attention, args, chain=(0,))
    row.update(us=round(t * 1e6, 2), gbps=round(batch * ctx * hk * (d + dv) * 2 / t / 1e9))
    return row


def prefill_row(key, causal, d, dv, batch=4, seqlen=4096, heads=(32, 8)):
    hq, hk = heads
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (batch, seqlen, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, seqlen, hk, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, seqlen, hk, dv), jnp.bfloat16)

    def fn(q, k, v):
        return jax_flash.flash_attention(q, k, v, causal=causal)

    row = {"kernel": _kernel(fn, q, k, v)}
    t, _ = timing.auto_loop_time(fn, (q, k, v), chain=(0,), target=0.1)
    flops = 2.0 * batch * hq * seqlen * seqlen * (d + dv) * (0.5 if causal else 1.0)
    row.update(ms=round(t * 1e3, 3), tflops=round(flops / t / 1e12, 1))
    return row


def main(out_dir, decode_only=False):
    key = jax.random.key(0)
    rows = {}
    jobs = [
        (f"decode {b}x{c // 1024}k D{d}/{dv}", decode_row, (key, b, c, d, dv))
        for b, c in ((64, 8192), (8, 8192), (1, 32768), (1, 8192))
        for d, dv in DECODE_DIMS
    ]
    if not decode_only:
        jobs += [
            (f"prefill B4 S4k {'causal' if c else 'full'} D{d}/{dv}", prefill_row, (key, c, d, dv))
            for c in (True, False)
            for d, dv in PREFILL_DIMS
        ]
    for name, fn, args in jobs:
        try:
            rows[name] = fn(*args)
        except Exception as e:
            rows[name] = {"error": str(e)[:200]}
        print(name, rows[name], flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "head_dims.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default="bench-results")
    ap.add_argument("--decode-only", action="store_true", help="the decode rows only")
    a = ap.parse_args()
    main(a.out_dir, a.decode_only)
