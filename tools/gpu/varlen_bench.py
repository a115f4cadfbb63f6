"""Packed prefill against dense on one GPU, one process: `flash_attention_varlen` over 8 packed
sequences of 512-4096 tokens (16k tokens in all) and `flash_attention` over 4 x 4k (the same
total), bf16, Hq 32 / Hkv 8, D 128 and 64, causal and full. TFLOP/s count 4 S^2 D per head and
sequence (half of it causal), so the ratio is the packed call's rate as a share of the dense
one's. Times are per call in a jitted loop (`jax_flash.bench.timing`).

    python tools/gpu/varlen_bench.py [OUT_DIR]   # writes OUT_DIR/varlen.json
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.bench import timing

LENS = (4096, 1024, 3072, 512, 2560, 1536, 2048, 1536)
HEADS = (32, 8)


def _tflops(lens, d, causal, seconds):
    flops = sum(4.0 * HEADS[0] * s * s * d for s in lens) * (0.5 if causal else 1.0)
    return flops / seconds / 1e12


def row(key, d, causal):
    hq, hk = HEADS
    total = sum(LENS)
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (total, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (total, hk, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (total, hk, d), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENS)]), jnp.int32)

    def packed(q, k, v):
        return jax_flash.flash_attention_varlen(q, k, v, cu, cu, causal=causal)

    def dense(q, k, v):
        shape = (4, total // 4)
        return jax_flash.flash_attention(
            *(x.reshape(*shape, *x.shape[1:]) for x in (q, k, v)), causal=causal
        )

    t_packed, _ = timing.auto_loop_time(packed, (q, k, v), chain=(0,), target=0.1)
    t_dense, _ = timing.auto_loop_time(dense, (q, k, v), chain=(0,), target=0.1)
    varlen = _tflops(LENS, d, causal, t_packed)
    dense_rate = _tflops((total // 4,) * 4, d, causal, t_dense)
    return {
        "head_dim": d,
        "causal": causal,
        "varlen_tflops": round(varlen, 1),
        "dense_4x4k_tflops": round(dense_rate, 1),
        "ratio": round(varlen / dense_rate, 3),
    }


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    key = jax.random.key(0)
    rows = []
    for d in (128, 64):
        for causal in (True, False):
            r = row(key, d, causal)
            print(r, flush=True)
            rows.append(r)
    result = {
        "lens": list(LENS),
        "heads": list(HEADS),
        "dtype": "bfloat16",
        "device": jax.devices()[0].device_kind,
        "timing": timing.METHOD,
        "rows": rows,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "varlen.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
