"""The serving benchmark's trace simulated: the engine's own `Scheduler` (admission with its
reserve, pages, preemption, chunked prefill) stepped by a step-time model instead of a device,
against static batching, on the benchmark's own traces (`make_trace` with its `--trace`
lengths: random prompt tokens, so no prefix is shared) and static batches (`static_batches`)
from benchmarks/serve_bench.py. No JAX device work; the default grid runs in about a minute
on a CPU.

    python tools/serve_sim.py                       # both traces, the grid below
    python tools/serve_sim.py --trace longtail --requests 128 --max-batch 48 --reserve 0 16

Prints one Markdown row per (trace, requests, max_batch, reserve): the engine / static
throughput ratio (the mean over ``--seeds``, and each seed's), the engine's preemptions, and
the simulated seconds of the engine's and static batching's runs with the static batches'
count (what a GPU run of the benchmark spends beyond its compiles).

Step-time model (``--card``), the 1.24B bf16 model:
- ``h100`` (fitted to the recorded H100 runs of docs/serving.md, whose host kept up with the
  device): an engine step costs 1.60 ms + 0.004 ms per decode row (rows padded to a power of
  two) + 6.2 us per prefill place (chunk rows padded to the chunk); static batching 1.66 ms
  per decode step and 6.2 us per prompt token; no host term.
- ``h200`` (the H200 runs of 2026-11-29): a 48-row decode step replayed alone 1.36 ms (1.10 ms
  + 0.004 ms per row of the 64 bucket), static batching 1.25 ms a decode step; prefill per
  place / token scaled from the H100's by the decode steps' ratio (4.7 us, assumed, not
  measured); and the host's work per dispatch (planning, packing, the jit dispatch, reading
  the tokens: 1.5-2.4 ms measured, ``--host-ms``, default 1.5), which overlaps the device's
  previous dispatch: a dispatch takes the longer of the two.
A dispatch of several decode steps (``--decode-steps``, `Engine`'s ``decode_steps``) costs its
steps' device time and one host term. Every request runs to its length (greedy, no stop
token). A model, not a measurement: it shows how the trace, max_batch, the reserve and the
decode steps move the throughput ratio."""

import argparse
import itertools
import os
import sys

import numpy as np

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]
from serve_bench import LongTailLengths, UniformLengths, make_trace, static_batches  # noqa: E402

from jax_flash.serve.pages import PagePool  # noqa: E402
from jax_flash.serve.request import Request, SamplingParams  # noqa: E402
from jax_flash.serve.scheduler import Scheduler  # noqa: E402

VOCAB = 128256
# Step-time models (the module docstring): `engine` and `static` keyword arguments per card.
CARDS = {
    "h100": dict(engine=dict(dstep=1.60, per_row=0.004, per_place=0.0062), static=dict()),
    "h200": dict(
        engine=dict(dstep=1.10, per_row=0.004, per_place=0.0047, host=1.5),
        static=dict(dstep=1.25, per_tok=0.0047),
    ),
}
# The benchmark's default lengths of each --trace (serve_bench.py, not --tiny).
LENGTHS = {
    "uniform": UniformLengths((64, 1024), (16, 512)),
    "longtail": LongTailLengths((64, 1024), output_median=128.0, max_output=2048),
}


def trace(n, rate, seed=0, kind="uniform"):
    return make_trace(np.random.default_rng(seed), n, rate, LENGTHS[kind], VOCAB)


def engine(
    tr,
    num_pages=1024,
    P=16,
    max_batch=48,
    rows=1,
    chunk=512,
    reserve=0,
    dstep=1.60,
    per_row=0.004,
    per_place=0.0062,
    host=0.0,
    decode_steps=1,
):
    """The engine's run of ``tr``: (tokens/s, dispatches, seconds, preemptions)."""
    pool = PagePool(num_pages)
    s = Scheduler(
        pool,
        P,
        max_batch=max_batch,
        max_prefill_rows=rows,
        prefill_chunk=chunk,
        reserve_tokens=reserve,
        decode_steps=decode_steps,
    )
    reqs = [
        Request(i, r["prompt"], r["max_new"], frozenset(), SamplingParams(), r["arrival"])
        for i, r in enumerate(tr)
    ]
    t, nxt, done, steps, toks = 0.0, 0, 0, 0, 0
    while done < len(reqs):
        while nxt < len(reqs) and reqs[nxt].arrival_s <= t:
            s.add(reqs[nxt])
            nxt += 1
        plan = s.schedule({})
        if plan is None:
            t = reqs[nxt].arrival_s
            continue
        nd, nc = len(plan.decode), len(plan.chunks)
        bucket = 1
        while bucket < nd:
            bucket *= 2
        device = (dstep + per_row * bucket + per_place * chunk * nc) * plan.steps
        t += max(device, host) / 1e3
        steps += 1
        for r, n in zip(plan.draws, plan.counts or [1] * len(plan.draws), strict=True):
            if r is None:
                continue
            r.pending -= n
            r.output += [0] * n
            toks += n
            if len(r.output) >= r.max_new_tokens:
                s.finish(r, "length")
                done += 1
    return toks / t, steps, t, s.stats.preemptions


def static(tr, num_pages=1024, P=16, max_batch=48, dstep=1.66, per_tok=0.0062):
    """Static batching's run of ``tr``: (tokens/s, seconds, batches)."""
    t, toks = 0.0, 0
    batches = static_batches(tr, num_pages, P, max_batch)
    for idx in batches:
        batch = [tr[i] for i in idx]
        start = max(t, max(r["arrival"] for r in batch))
        prefill = sum(len(r["prompt"]) for r in batch) * per_tok
        t = start + (prefill + (max(r["max_new"] for r in batch) - 1) * dstep) / 1e3
        toks += sum(r["max_new"] for r in batch)
    return toks / t, t, len(batches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    parser.add_argument("--requests", nargs="+", type=int, default=[48, 128, 256])
    parser.add_argument("--max-batch", nargs="+", type=int, default=[16, 48, 64])
    parser.add_argument("--reserve", nargs="+", type=int, default=[0, 16, 32])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rate", type=float, default=100.0, help="arrivals per second")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--card", choices=list(CARDS), default="h100", help="step-time model")
    parser.add_argument("--host-ms", type=float, default=1.5, help="h200: host ms a dispatch")
    parser.add_argument("--decode-steps", nargs="+", type=int, default=[1])
    args = parser.parse_args()
    card = {k: dict(v) for k, v in CARDS[args.card].items()}
    if args.card == "h200":
        card["engine"]["host"] = args.host_ms
    print(
        "| trace | requests | max_batch | reserve | decode steps | ratio (mean; per seed) "
        "| preemptions | engine s | static s (batches) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.trace:
        for n in args.requests:
            traces = [trace(n, args.rate, seed, kind) for seed in args.seeds]
            for mb in args.max_batch:
                statics = [
                    static(tr, args.num_pages, max_batch=mb, **card["static"]) for tr in traces
                ]
                for k, ds in itertools.product(args.reserve, args.decode_steps):
                    runs = [
                        engine(
                            tr, args.num_pages, max_batch=mb, reserve=k, decode_steps=ds,
                            **card["engine"],
                        )
                        for tr in traces
                    ]  # fmt: skip
                    ratios = [e[0] / st[0] for e, st in zip(runs, statics, strict=True)]
                    each = " ".join(f"{x:.2f}" for x in ratios)
                    pre = " ".join(str(e[3]) for e in runs)
                    te = " ".join(f"{e[2]:.1f}" for e in runs)
                    ts = " ".join(f"{st[1]:.1f} ({st[2]})" for st in statics)
                    print(
                        f"| {kind} | {n} | {mb} | {k} | {ds} | {np.mean(ratios):.2f}x; {each} "
                        f"| {pre} | {te} | {ts} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
