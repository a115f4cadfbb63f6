"""Multi-device benchmark: batch-sharded prefill and head-sharded paged decode, one device
against N.

    python benchmarks/sharding_bench.py [--devices 1,2,4] [--out sharding.json]

Cases (on GPU; a CPU run takes small shapes, as a smoke test of the script and the rules):
  prefill  q/k/v [8, 4096, 32 | 8, 128] bfloat16, causal and not, sharded on batch
  decode   paged decode of 64 sequences x 4096 tokens, 32/8 heads, D 128, pages of 16,
           bfloat16: q and the page pools sharded on heads (KV heads with their query heads),
           block tables and lengths replicated
For each device count n (the first n of jax.devices()), a call is timed inside a jitted loop
(`jax_flash.bench.auto_loop_time`: chained calls, the slope between loop lengths) on a 1-D mesh
of n devices; the table gives the time per call, the speed-up over one device, and the
collectives in the compiled call (none expected). The JSON (--out) holds the rows and the run's
devices and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import bench

COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\("
)


def shapes(gpu: bool) -> dict:
    if gpu:
        return {
            "prefill": dict(B=8, S=4096, Hq=32, Hkv=8, D=128),
            "decode": bench.DecodeShape(64, 4096, 32, 8, 128, 16, "bfloat16", "bfloat16"),
        }
    return {
        "prefill": dict(B=8, S=256, Hq=8, Hkv=4, D=64),
        "decode": bench.DecodeShape(8, 512, 8, 4, 64, 16, "bfloat16", "bfloat16"),
    }


def prefill_case(s, causal):
    keys = jax.random.split(jax.random.key(0), 3)
    dt = jnp.bfloat16
    q = jax.random.normal(keys[0], (s["B"], s["S"], s["Hq"], s["D"]), dt)
    k = jax.random.normal(keys[1], (s["B"], s["S"], s["Hkv"], s["D"]), dt)
    v = jax.random.normal(keys[2], (s["B"], s["S"], s["Hkv"], s["D"]), dt)

    def fn(q, k, v):
        return jax_flash.flash_attention(q, k, v, causal=causal)

    # Batch (data parallel) sharding of q, k and v; the output keeps it.
    name = f"prefill {s['B']}x{s['S']} {s['Hq']}/{s['Hkv']} D{s['D']} causal={causal}"
    return name, fn, (q, k, v), [P("x")] * 3, P("x")


def decode_case(s):
    q, kp, vp, bt, lens, _, _ = bench.make_paged(s, jax.random.key(1))

    def fn(q, kp, vp, bt, lens):
        return jax_flash.paged_attention(q, kp, vp, bt, lens)

    # Head (tensor parallel) sharding: q heads with their KV heads' pages.
    heads, pool = P(None, "x"), P(None, None, "x")
    name = f"decode {s.batch}x{s.ctx} {s.heads_q}/{s.heads_kv} D{s.head_dim} page{s.page_size}"
    return name, fn, (q, kp, vp, bt, lens), [heads, pool, pool, P(), P()], heads


def time_on(fn, args, specs, out_spec, n):
    """(seconds per call, collectives in the compiled call) on a mesh of the first n devices.

    Only q (argument 0) is chained from call to call. The timing loop carries the output: it is
    pinned to its sharding, else the loop's carry (zeros at first) may be replicated and the
    output gathered every call; and the loop reads the first element of the first output leaf,
    here that element alone (flattening a head-sharded output would gather it). The chain's
    one-element update of q costs two one-element all-reduces per call under a mesh (the
    partitioner does not place element 0 statically): a few microseconds, in the N-device times
    only."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    out_sharding = NamedSharding(mesh, out_spec)

    def pinned(*a):
        o = jax.lax.with_sharding_constraint(fn(*a), out_sharding)
        return o[(0,) * o.ndim], o

    text = jax.jit(fn).lower(*put).compile().as_text()
    collectives = sorted({m[0] for m in COLLECTIVE.findall(text)})
    t, _ = bench.auto_loop_time(pinned, put, chain=(0,))
    return t, collectives


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default=None, help="device counts, e.g. 1,2,4 (default 1 and all)")
    ap.add_argument("--out", default="sharding_bench.json", help="JSON output path")
    a = ap.parse_args()
    total = jax.device_count()
    counts = [1, total] if a.devices is None else [int(c) for c in a.devices.split(",")]
    if any(c < 1 or c > total for c in counts):
        raise SystemExit(f"--devices {counts}: this machine has {total} devices")
    counts = sorted(set(counts))
    gpu = jax.devices()[0].platform == "gpu"
    sh = shapes(gpu)
    cases = [prefill_case(sh["prefill"], c) for c in (True, False)] + [decode_case(sh["decode"])]

    dev = jax.devices()[0]
    run_info = {
        "device": str(dev.device_kind),
        "platform": dev.platform,
        "device_count": total,
        "jax": jax.__version__,
        "jax_flash": jax_flash.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    print(f"# {run_info['device']} x {total}, jax {run_info['jax']}", flush=True)
    rows = []
    header = f"{'case':<48} {'devices':>7} {'ms/call':>9} {'speed-up':>8}  collectives"
    print(header)
    for name, fn, args, specs, out_spec in cases:
        base = None
        for n in counts:
            t, coll = time_on(fn, args, specs, out_spec, n)
            base = t if n == counts[0] else base
            speedup = base / t if t > 0 else float("nan")
            rows.append(
                dict(case=name, devices=n, ms=t * 1e3, speedup_vs_first=speedup, collectives=coll)
            )
            print(f"{name:<48} {n:>7} {t * 1e3:>9.3f} {speedup:>7.2f}x  {','.join(coll) or '-'}")
    with open(a.out, "w") as f:
        json.dump({"info": run_info, "counts": counts, "rows": rows}, f, indent=1)
    print(f"# saved {a.out}")


if __name__ == "__main__":
    main()
