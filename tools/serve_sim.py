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

Step-time model (the 1.24B bf16 model on an H100, fitted to the recorded runs of
docs/serving.md): an engine step costs 1.60 ms + 0.004 ms per decode row (rows padded to a
power of two) + 6.2 us per prefill place (chunk rows padded to the chunk); static batching
1.66 ms per decode step and 6.2 us per prompt token. Tokens are read back at once (no
overlap); every request runs to its length (greedy, no stop token). A model, not a
measurement: it shows how the trace, max_batch and the reserve move the throughput ratio."""

import argparse
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
):
    """The engine's run of ``tr``: (tokens/s, steps, seconds, preemptions)."""
    pool = PagePool(num_pages)
    s = Scheduler(
        pool,
        P,
        max_batch=max_batch,
        max_prefill_rows=rows,
        prefill_chunk=chunk,
        reserve_tokens=reserve,
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
        t += (dstep + per_row * bucket + per_place * chunk * nc) / 1e3
        steps += 1
        for r in plan.draws:
            if r is None:
                continue
            r.pending -= 1
            r.output.append(0)
            toks += 1
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
    args = parser.parse_args()
    print(
        "| trace | requests | max_batch | reserve | ratio (mean; per seed) | preemptions "
        "| engine s | static s (batches) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.trace:
        for n in args.requests:
            traces = [trace(n, args.rate, seed, kind) for seed in args.seeds]
            for mb in args.max_batch:
                statics = [static(tr, args.num_pages, max_batch=mb) for tr in traces]
                for k in args.reserve:
                    runs = [engine(tr, args.num_pages, max_batch=mb, reserve=k) for tr in traces]
                    ratios = [e[0] / st[0] for e, st in zip(runs, statics, strict=True)]
                    each = " ".join(f"{x:.2f}" for x in ratios)
                    pre = " ".join(str(e[3]) for e in runs)
                    te = " ".join(f"{e[2]:.1f}" for e in runs)
                    ts = " ".join(f"{st[1]:.1f} ({st[2]})" for st in statics)
                    print(
                        f"| {kind} | {n} | {mb} | {k} | {np.mean(ratios):.2f}x; {each} | {pre} "
                        f"| {te} | {ts} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
