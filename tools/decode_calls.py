"""Calls jax_flash.paged_attention on one benchmark decode shape, N times, outside any timing
loop, so that a profiler sees the kernels exactly as JAX launches them:

    ncu --clock-control none --kernel-name regex:paged_attention \\
        --launch-skip 5 --launch-count 3 --metrics gpu__time_duration.sum \\
        python tools/decode_calls.py --batch 64 --ctx 8192 --cache float8_e4m3fn

It also prints the wall time per call of a plain Python loop of jitted calls (async dispatch,
one block_until_ready at the end) beside the benchmark loop's (the slope between chained loops
of n and n // 5 calls), to compare the kernel's own duration with what the benchmark measures;
--splits times several num_splits values in turn.
"""

from __future__ import annotations

import argparse
import time

import jax

import jax_flash
from jax_flash import bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache", default=None, help="cache dtype (default: --dtype)")
    ap.add_argument("--scales", choices=["token", "head"], default="token")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--splits", type=int, nargs="*", default=[None], help="num_splits values")
    a = ap.parse_args(argv)
    s = bench.DecodeShape(
        a.batch,
        a.ctx,
        a.heads[0],
        a.heads[1],
        a.head_dim,
        a.page_size,
        a.dtype,
        a.cache or a.dtype,
        scales=a.scales,
    )
    data = bench.make_paged(s, jax.random.key(0))
    q, kp, vp, bt, kl, ks, vs = data
    for splits in a.splits:
        f = jax.jit(
            lambda q, kp, vp, bt, kl, ks, vs, n=splits: jax_flash.paged_attention(
                q, kp, vp, bt, kl, k_scale=ks, v_scale=vs, num_splits=n
            )
        )
        jax.block_until_ready(f(*data))
        t0 = time.perf_counter()
        outs = [f(*data) for _ in range(a.calls)]
        jax.block_until_ready(outs)
        plain = (time.perf_counter() - t0) / a.calls
        loop, _ = bench.loop_time(f, data, n=max(a.calls, 20), chain=bench.DECODE_CHAIN)
        print(
            f"{s.label()} splits {splits or 'default'}: plain loop {plain * 1e6:.1f} us/call, "
            f"benchmark loop {loop * 1e6:.1f} us/call, {s.kv_bytes / loop / 1e9:.0f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
