"""Multi-device benchmark: batch-sharded prefill, head-sharded paged decode and sequence-sharded
causal prefill, one device against N.

    python benchmarks/sharding_bench.py [--devices 1,2,4] [--cases prefill,decode,sequence]
        [--seqlen 131072] [--no-backward] [--out sharding.json]

Cases (on GPU; a CPU run takes small shapes, as a smoke test of the script and the rules):
  prefill  q/k/v [8, 4096, 32 | 8, 128] bfloat16, causal and not, sharded on batch
  decode   paged decode of 64 sequences x 4096 tokens, 32/8 heads, D 128, pages of 16,
           bfloat16: q and the page pools sharded on heads (KV heads with their query heads),
           block tables and lengths replicated
  sequence causal prefill of one sequence of --seqlen tokens (default 131072), 32/8 heads,
           D 128, bfloat16, q/k/v sharded on the sequence (context parallelism in the partitioned
           lowering): "balanced" (each device computes the zigzag half-blocks d and 2n-1-d) and
           "natural" (each device its own rows, `_sequence_layout="natural"`), the forward and
           the forward + backward (jax.grad of sum(o * do) in q, k and v, do sharded like q);
           with each the bound on the speed-up from the devices' tile counts
           (primitives/sequence_sharding.device_work: sum / max) and the result's relative
           error against one device
For each device count n (the first n of jax.devices()), a call is timed inside a jitted loop
(`jax_flash.bench.auto_loop_time`: chained calls, the slope between loop lengths; the sequence
cases, whose calls are long, a loop of a few calls: `loop_time`) on a 1-D mesh of n devices; the
table gives the time per call, the speed-up over one device, and the collectives in the
compiled call (none expected for batch and heads). The JSON (--out) holds the rows and the run's
devices and versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import bench
from jax_flash.primitives.flash_attention import FlashConfig
from jax_flash.primitives.sequence_sharding import device_work

COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\("
)


def shapes(gpu: bool) -> dict:
    if gpu:
        return {
            "prefill": dict(B=8, S=4096, Hq=32, Hkv=8, D=128),
            "decode": bench.DecodeShape(64, 4096, 32, 8, 128, 16, "bfloat16", "bfloat16"),
            "sequence": dict(S=131072, Hq=32, Hkv=8, D=128),
        }
    return {
        "prefill": dict(B=8, S=256, Hq=8, Hkv=4, D=64),
        "decode": bench.DecodeShape(8, 512, 8, 4, 64, 16, "bfloat16", "bfloat16"),
        "sequence": dict(S=1024, Hq=8, Hkv=2, D=64),
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


@dataclasses.dataclass
class SequenceCase:
    """A sequence-sharded causal prefill: `layout` is flash_attention's _sequence_layout
    ("auto": balanced), `flops` the call's matmul FLOPs (to size the timing loop)."""

    name: str
    fn: object
    args: tuple
    layout: str
    flops: float


def _sequence_call(q, k, v, do, *, layout, backward):
    def attend(q, k, v):
        return jax_flash.flash_attention(q, k, v, causal=True, _sequence_layout=layout)

    if not backward:
        return attend(q, k, v)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def sequence_cases(s, backward: bool):
    keys = jax.random.split(jax.random.key(2), 4)
    dt = jnp.bfloat16
    S, Hq, Hkv, D = s["S"], s["Hq"], s["Hkv"], s["D"]
    q = jax.random.normal(keys[0], (1, S, Hq, D), dt)
    k = jax.random.normal(keys[1], (1, S, Hkv, D), dt)
    v = jax.random.normal(keys[2], (1, S, Hkv, D), dt)
    do = jax.random.normal(keys[3], (1, S, Hq, D), dt)
    fwd_flops = 4.0 * S * S * Hq * D / 2  # QK^T and PV over the causal half
    base = f"sequence 1x{S} {Hq}/{Hkv} D{D} causal"
    passes = [("fwd", fwd_flops)] + ([("fwd+bwd", 3.5 * fwd_flops)] if backward else [])
    cases = []
    for kind, flops in passes:  # fwd+bwd: the backward is ~2.5x the forward's matmuls
        for layout in ("auto", "natural"):
            fn = functools.partial(_sequence_call, layout=layout, backward=kind == "fwd+bwd")
            label = "balanced" if layout == "auto" else "natural"
            cases.append(SequenceCase(f"{base} {kind} {label}", fn, (q, k, v, do), layout, flops))
    return cases


def work_bound(layout: str, n: int, S: int) -> float:
    """sum / max of the devices' tile counts: the speed-up the layout allows."""
    config = FlashConfig(
        1.0, 0.0, -1, 0, S, False, None, dense=True, _sequence_layout=layout
    )  # fmt: skip
    work = device_work(config, n, S, S)
    return sum(work) / max(work)


@jax.jit
def rel_err(out, ref):
    num = sum(jnp.sum((o.astype(jnp.float32) - r.astype(jnp.float32)) ** 2) for o, r in
              zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True))  # fmt: skip
    den = sum(jnp.sum(r.astype(jnp.float32) ** 2) for r in jax.tree.leaves(ref))
    return jnp.sqrt(num / den)


def time_sequence(case: SequenceCase, n: int, gpu: bool):
    """(seconds per call, collectives, output on device 0) of a sequence case on the first n
    devices, q/k/v/do sharded on the sequence; a loop of a few calls (each is long)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    spec = P(None, "x")
    put = [jax.device_put(a, NamedSharding(mesh, spec)) for a in case.args]
    out_sharding = NamedSharding(mesh, spec)

    def pinned(*a):
        o = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, out_sharding), case.fn(*a))
        first = jax.tree.leaves(o)[0]
        return first[(0,) * first.ndim], o

    text = jax.jit(case.fn).lower(*put).compile().as_text()
    collectives = sorted({m[0] for m in COLLECTIVE.findall(text)})
    est = case.flops / (4e14 if gpu else 1e10) / n
    calls = bench.pick_n(est, 1.0 if gpu else 0.2, 2, 50)
    t, (_, out) = bench.loop_time(pinned, put, n=calls, chain=(0,), runs=3)
    return t, collectives, jax.device_put(out, jax.devices()[0])


def run_sequence(cases, counts, gpu, rows):
    """The sequence cases: one device once per pass (the layouts only differ when sharded),
    then each layout on each larger count."""
    base = {}
    for case in cases:
        kind = case.name.rsplit(" ", 1)[0]  # the pass: name without the layout
        for n in counts:
            if n == 1 and kind in base:
                continue
            t, coll, out = time_sequence(case, n, gpu)
            if n == 1:
                base[kind] = (t, out)
            t1, ref = base.get(kind, (t, out))
            err = float(rel_err(out, ref))
            bound = work_bound(case.layout, n, case.args[0].shape[1]) if n > 1 else 1.0
            speedup = t1 / t if t > 0 else float("nan")
            name = kind if n == 1 else case.name
            rows.append(dict(case=name, devices=n, ms=t * 1e3, speedup_vs_first=speedup,
                             work_bound=bound, rel_err=err, collectives=coll))  # fmt: skip
            print(
                f"{name:<48} {n:>7} {t * 1e3:>9.3f} {speedup:>7.2f}x  {','.join(coll) or '-'}"
                f"  (work bound {bound:.2f}x, rel err {err:.1e})",
                flush=True,
            )


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
    ap.add_argument(
        "--cases", default="prefill,decode,sequence", help="comma-separated subset to run"
    )
    ap.add_argument("--seqlen", type=int, default=None, help="the sequence case's length")
    ap.add_argument("--no-backward", action="store_true", help="the sequence case's forward only")
    a = ap.parse_args()
    picked = set(a.cases.split(","))
    if not picked <= {"prefill", "decode", "sequence"}:
        raise SystemExit(f"--cases {a.cases}: choose from prefill, decode, sequence")
    total = jax.device_count()
    counts = [1, total] if a.devices is None else [int(c) for c in a.devices.split(",")]
    if any(c < 1 or c > total for c in counts):
        raise SystemExit(f"--devices {counts}: this machine has {total} devices")
    counts = sorted(set(counts))
    gpu = jax.devices()[0].platform == "gpu"
    sh = shapes(gpu)
    cases = []
    if "prefill" in picked:
        cases += [prefill_case(sh["prefill"], c) for c in (True, False)]
    if "decode" in picked:
        cases.append(decode_case(sh["decode"]))
    if a.seqlen is not None:
        sh["sequence"]["S"] = a.seqlen

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
    if "sequence" in picked:
        run_sequence(sequence_cases(sh["sequence"], not a.no_backward), counts, gpu, rows)
    with open(a.out, "w") as f:
        json.dump({"info": run_info, "counts": counts, "rows": rows}, f, indent=1)
    print(f"# saved {a.out}")


if __name__ == "__main__":
    main()
