"""One jitted attention call for Nsight Compute to profile: the forward, or the forward + vjp
w.r.t. q, k, v (`jax_flash.bench.backward`'s), of jax_flash or a backward peer, bf16, on fresh
random inputs. ncu reads the hardware counters on the lent H100 / H200 machines with its clock
control off (leave the clocks alone); a kernel-name filter skips XLA's own kernels:

    ncu --clock-control none --set full --launch-count 1 --kernel-name regex:flash_bwd_hopper \\
        -o OUT python tools/gpu/ncu_call.py bwd jax_flash --batch 4 --seqlen 4096
    ncu --clock-control none --set full --launch-count 2 \\
        --kernel-name 'regex:(?i)sdpa|bprop' -o OUT python tools/gpu/ncu_call.py bwd cudnn
    ncu --import OUT.ncu-rep --page details           # sections: throughput, stalls, occupancy
    ncu --import OUT.ncu-rep --page source --print-source sass --csv > OUT.csv
    python tools/gpu/ncu_hotspots.py OUT.csv          # the SASS lines the warps stall on

(The backward NOTES' stall analysis, benchmarks/results/NOTES-hopper-bwd.md, came this way.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench.backward import fwd_bwd
from jax_flash.bench.peers import backward_peers
from jax_flash.bench.shapes import PrefillShape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["fwd", "bwd"])
    ap.add_argument("peer", nargs="?", default="jax_flash", help="bwd: a backward peer's name")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="non-causal (default causal)")
    args = ap.parse_args()

    hq, hkv = args.heads
    s = PrefillShape(args.batch, args.seqlen, hq, hkv, args.dim, not args.full, "bfloat16")
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (s.batch, s.seqlen, hq, s.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (s.batch, s.seqlen, hkv, s.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (s.batch, s.seqlen, hkv, s.head_dim), jnp.bfloat16)
    if args.mode == "fwd":
        out = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=s.causal))(q, k, v)
    else:
        fn = backward_peers(jax.devices()[0].platform, s).get(args.peer)
        if fn is None or isinstance(fn, str):
            raise SystemExit(f"ncu_call: backward peer {args.peer!r}: {fn or 'unknown'}")
        do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
        out = jax.jit(fwd_bwd(fn))(q, k, v, do)
    jax.block_until_ready(out)
    print(f"ncu_call: {args.mode} {args.peer} {s} done")


if __name__ == "__main__":
    main()
