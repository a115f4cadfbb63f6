"""Context-parallel prefill: one long causal sequence on 1 device against N devices.

    python benchmarks/context_parallel_bench.py [--seqlen 131072 32768] [--devices 4]
        [--heads-q 32 --heads-kv 8 --head-dim 128 --dtype bfloat16] [--out cp.json]

For each sequence length it times `jax_flash.flash_attention` (causal, batch 1) on the first
device, then `jax_flash.context_parallel_attention` with the sequence sharded over N devices
(default: all visible) for each strategy ("ring", "allgather") and layout ("natural"; "zigzag"
taking and returning natural order, i.e. with the on-device reorder; "zigzag" on inputs already
in zigzag order, i.e. without it), the way every jax_flash benchmark times a call (chained calls
in one jitted loop, `jax_flash.bench.loop_time`). It prints a table with the speed-up over one
device and each result's relative error against the one-device output, the reorder's cost (the
difference between the two zigzag rows), and the strategy ``strategy="auto"`` picks; `--out`
saves the rows as JSON (rewritten after every row).

CPU smoke run (host devices; small default sizes when the devices are CPUs):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/context_parallel_bench.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import bench, parallel
from jax_flash.bench import device as bench_device

# (strategy, layout, inputs already in zigzag order)
CONFIGS = [
    ("ring", "natural", False),
    ("ring", "zigzag", False),
    ("ring", "zigzag", True),
    ("allgather", "natural", False),
    ("allgather", "zigzag", False),
    ("allgather", "zigzag", True),
]


def causal_flops(s, hq, d) -> float:
    """Matmul FLOPs of causal attention over one sequence (half of QK^T and PV)."""
    return 4.0 * s * s * hq * d / 2


def time_call(fn, args, est_s: float, on_gpu: bool):
    """(seconds per call, last output) of fn(*args), q chained from call to call."""
    n = bench.pick_n(est_s, 1.0 if on_gpu else 0.2, 2, 50)
    return bench.loop_time(fn, args, n=n, chain=(0,), runs=3)


@jax.jit
def rel_err(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, nargs="+", help="default 131072 32768 (GPU)")
    parser.add_argument("--devices", type=int, nargs="+", help="N (default: all visible)")
    parser.add_argument("--heads-q", type=int)
    parser.add_argument("--heads-kv", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype", help="default bfloat16 (GPU), float32 (CPU)")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=("ring", "allgather"),
        default=("ring", "allgather"),
        help="strategies to time (default both)",
    )
    parser.add_argument(
        "--zigzag-only", action="store_true", help="skip the natural-layout rows (slow for causal)"
    )
    args = parser.parse_args()

    devices = jax.devices()
    on_gpu = devices[0].platform == "gpu"
    seqlens = args.seqlen or ([131072, 32768] if on_gpu else [512, 256])
    hq = args.heads_q or (32 if on_gpu else 4)
    hkv = args.heads_kv or (8 if on_gpu else 1)
    d = args.head_dim or (128 if on_gpu else 64)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    counts = args.devices or [len(devices)]
    if max(counts) > len(devices):
        parser.error(f"--devices {max(counts)}: only {len(devices)} devices visible")
    rate = 4e14 if on_gpu else 1e10  # FLOP/s per device, only to size the timing loops

    info = bench_device.info(devices[0])
    info["device_count"] = len(devices)
    result = {
        "benchmark": "context_parallel",
        "info": info,
        "config": dict(batch=1, heads_q=hq, heads_kv=hkv, head_dim=d, dtype=dtype.name),
        "rows": [],
    }
    print(
        f"device: {info['device']} x {len(devices)}; jax {jax.__version__}; jax_flash "
        f"{jax_flash.__version__}; causal, batch 1, heads {hq}/{hkv} x {d}, {dtype.name}"
    )

    def save():
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    header = (
        f"{'seqlen':>8}{'N':>3}  {'strategy':<10}{'layout':<22}{'ms':>10}{'TFLOP/s':>9}"
        f"{'speed-up':>9}{'rel err':>10}"
    )
    for s in seqlens:
        keys = jax.random.split(jax.random.key(s), 3)
        first = devices[0]
        q, k, v = (
            jax.device_put(jax.random.normal(key, (1, s, h, d), dtype), first)
            for key, h in zip(keys, (hq, hkv, hkv), strict=True)
        )
        flops = causal_flops(s, hq, d)
        one = functools.partial(jax_flash.flash_attention, causal=True)
        t1, ref = time_call(one, (q, k, v), flops / rate, on_gpu)
        print(f"\n{header}")
        row = dict(seqlen=s, devices=1, strategy="-", layout="-", ms=t1 * 1e3)
        row.update(tflops=flops / t1 / 1e12, speedup=1.0, rel_err=0.0)
        result["rows"].append(row)
        print(f"{s:>8}{1:>3}  {'one device':<32}{t1 * 1e3:>10.2f}{row['tflops']:>9.1f}{1.0:>9.2f}")
        save()
        for n in counts:
            if n == 1:
                continue
            mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=devices[:n])
            sharded = NamedSharding(mesh, P(None, "seq"))
            natural = [jax.device_put(x, sharded) for x in (q, k, v)]
            to_zz = jax.jit(functools.partial(parallel.to_zigzag, n=n), out_shardings=sharded)
            zigzagged = [to_zz(x) for x in natural] if s % (2 * n) == 0 else None
            times = {}
            for strategy, layout, pre in CONFIGS:
                if layout == "zigzag" and zigzagged is None:
                    continue
                if strategy not in args.strategies or (args.zigzag_only and layout == "natural"):
                    continue
                fn = functools.partial(
                    jax_flash.context_parallel_attention,
                    mesh=mesh,
                    seq_axis="seq",
                    causal=True,
                    strategy=strategy,
                    layout=layout,
                    reorder=not pre,
                )
                t, o = time_call(fn, tuple(zigzagged if pre else natural), flops / rate / n, on_gpu)
                if pre:
                    o = parallel.from_zigzag(o, n)
                err = float(rel_err(jax.device_put(o, first), ref))
                times[strategy, layout, pre] = t
                name = f"{layout}{' (pre-ordered)' if pre else ''}"
                row = dict(seqlen=s, devices=n, strategy=strategy, layout=name, ms=t * 1e3)
                row.update(tflops=flops / t / 1e12, speedup=t1 / t, rel_err=err)
                result["rows"].append(row)
                print(
                    f"{s:>8}{n:>3}  {strategy:<10}{name:<22}{t * 1e3:>10.2f}"
                    f"{row['tflops']:>9.1f}{t1 / t:>9.2f}{err:>10.2e}"
                )
                save()
            for strategy in ("ring", "allgather"):
                if (strategy, "zigzag", True) in times:
                    cost = times[strategy, "zigzag", False] - times[strategy, "zigzag", True]
                    print(f"    zigzag reorder ({strategy}): {cost * 1e3:.2f} ms per call")
            gathered = s * hkv * 2 * d * dtype.itemsize
            # Causal with no window: every ring step has work, the ring runs all n steps.
            picked = parallel.choose_strategy(n=n, gathered_kv_bytes=gathered, ring_steps=n)
            print(f"    strategy='auto' picks {picked!r} here")
    save()
    if args.out:
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
