"""Where a forward + backward attention call spends its GPU time: the kernels (and memsets) of
a few traced calls of `jax_flash.bench.backward`'s jitted forward + vjp, summed by name per call,
for jax_flash and the peers asked for, on the same inputs.

    python tools/gpu/profile_backward.py [--batch 4] [--seqlen 4096] [--heads 32 8] [--dim 128]
                                         [--causal | --full] [--peers jax_flash cudnn]
                                         [--calls 5] [--top 12]

Peers are `jax_flash.bench.peers.backward_peers`' names (jax_flash, jax_flash_det, cudnn, fa3,
tokamax, ...). Each peer's line gives its kernels' busy time per call and the TFLOP/s that time
alone would give (3.5x the forward FLOPs), so the share of each kernel (the backward's zeroing,
preprocessing, main kernel and dQ conversion) can be read against the whole.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from profile_generate import busy_ns, gpu_kernels  # noqa: E402

from jax_flash.bench.backward import FWD_BWD_FLOPS, fwd_bwd  # noqa: E402
from jax_flash.bench.peers import backward_peers  # noqa: E402
from jax_flash.bench.shapes import PrefillShape  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    mask = ap.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True)
    mask.add_argument("--full", dest="causal", action="store_false")
    ap.add_argument("--peers", nargs="+", default=["jax_flash", "cudnn"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()

    s = PrefillShape(args.batch, args.seqlen, *args.heads, args.dim, args.causal, args.dtype)
    dtype = jnp.dtype(s.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (s.batch, s.seqlen, s.heads_q, s.head_dim), dtype)
    k = jax.random.normal(keys[1], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
    v = jax.random.normal(keys[2], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    print(f"{s} on {jax.devices()[0].device_kind}", flush=True)
    peers = backward_peers(jax.devices()[0].platform, s)
    for name in args.peers:
        fn = peers.get(name)
        if fn is None or isinstance(fn, str):
            print(f"{name}: {fn or 'not a backward peer'}")
            continue
        call = jax.jit(fwd_bwd(fn))
        jax.block_until_ready(call(q, k, v, do))  # compiles
        with tempfile.TemporaryDirectory() as tdir:
            with jax.profiler.trace(tdir):
                for _ in range(args.calls):
                    jax.block_until_ready(call(q, k, v, do))
            events = gpu_kernels(tdir)
        if not events:
            sys.exit("no GPU kernels in the trace (no GPU, or the profiler saw none)")
        busy = busy_ns(events) / args.calls
        tflops = FWD_BWD_FLOPS * s.flops / (busy * 1e-9) / 1e12
        print(f"{name}: {busy / 1e3:.1f} us busy a call ({tflops:.0f} TFLOP/s on that time)")
        by_name = collections.defaultdict(lambda: [0, 0])
        for _, d, kname in events:
            by_name[kname][0] += 1
            by_name[kname][1] += d
        for kname, (n, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[: args.top]:
            per_call = t / args.calls / 1e3
            print(
                f"  {per_call:9.1f} us {100 * t / args.calls / busy:5.1f}%  x{n / args.calls:g}"
                f"  {kname[:110]}"
            )


if __name__ == "__main__":
    main()
