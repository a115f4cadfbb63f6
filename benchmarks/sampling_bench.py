"""Sampling benchmark: jax_flash.sample against the jnp path on the default device.

    python benchmarks/sampling_bench.py [--batch 64] [--vocab 131072] [--dtype float32]

For each filter setting it times jax_flash.sample (and jax_flash.top_k_top_p_filter) and the
usual jnp implementation of the same filters (lax.top_k, or a full sort for top-p without top-k,
then jax.random.categorical) the way every jax_flash benchmark times a call
(`jax_flash.bench.auto_loop_time`: chained calls in one jitted loop, the slope between loop
lengths, so dispatch and synchronisation stay out), and prints a table with the device's name.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flash import bench
from jax_flash.ops.sampling import sample, top_k_top_p_filter

CONFIGS = [
    ("greedy", dict(temperature=0.0)),
    ("temperature 0.8", dict(temperature=0.8)),
    ("top_k 50", dict(temperature=0.8, top_k=50)),
    ("top_k 50, top_p 0.9", dict(temperature=0.7, top_k=50, top_p=0.9)),
    ("top_p 0.9", dict(temperature=0.8, top_p=0.9)),
    ("top_p 0.95, min_p 0.05", dict(temperature=1.0, top_p=0.95, min_p=0.05)),
]


def jnp_sample(logits, key, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The usual jnp sampler: lax.top_k when top_k is set, else a full descending sort."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits.astype(jnp.float32) / temperature
    if not (top_k or top_p < 1.0 or min_p > 0.0):
        return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
    if top_k:
        vals, idx = lax.top_k(x, top_k)
    else:
        idx = jnp.argsort(-x, axis=-1)
        vals = jnp.take_along_axis(x, idx, axis=-1)
    if top_p < 1.0:
        probs = jax.nn.softmax(vals, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
        vals = jnp.where(before < top_p, vals, -jnp.inf)
    if min_p > 0.0:
        vals = jnp.where(vals >= vals[:, :1] + jnp.log(min_p), vals, -jnp.inf)
    choice = jax.random.categorical(key, vals, axis=-1)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def call_us(fn, *args) -> float:
    """Microseconds per call of fn(logits, ...), the logits chained from call to call."""
    t, _ = bench.auto_loop_time(fn, args, chain=(0,))
    return t * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()

    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((args.batch, args.vocab), np.float32) * 2.5)
    logits = jax.device_put(logits.astype(args.dtype), device)
    key = jax.random.key(0)
    print(
        f"device: {device.device_kind} ({device.platform}); logits [{args.batch}, {args.vocab}] "
        f"{args.dtype}; microseconds per call (chained calls in one jitted loop)"
    )
    header = f"{'filters':<26}{'sample':>10}{'filter':>10}{'jnp':>10}{'jnp/sample':>12}"
    print(header)
    print("-" * len(header))
    for name, cfg in CONFIGS:
        ours = call_us(functools.partial(sample, **cfg), logits, key)
        filt = call_us(functools.partial(top_k_top_p_filter, **cfg), logits)
        ref = call_us(functools.partial(jnp_sample, **cfg), logits, key)
        print(f"{name:<26}{ours:>10.1f}{filt:>10.1f}{ref:>10.1f}{ref / ours:>11.2f}x")


if __name__ == "__main__":
    main()
