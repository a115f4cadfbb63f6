"""The serving benchmark's trace simulated: the engine's own `Scheduler` (admission, pages,
preemption, chunked prefill) stepped by a step-time model instead of a device, against static
batching, on the benchmark's own trace (`make_trace`: random prompt tokens, so no prefix is
shared) and static batches (`static_batches`) from benchmarks/serve_bench.py. No JAX device
work; runs in seconds on a CPU.

    python tools/serve_sim.py

Step-time model (the 1.24B bf16 model on an H100, fitted to the recorded runs of
docs/serving.md): an engine step costs 1.60 ms + 0.004 ms per decode row (rows padded to a
power of two) + 6.2 us per prefill place (chunk rows padded to the chunk); static batching
1.66 ms per decode step and 6.2 us per prompt token. Tokens are read back at once (no
overlap); every request runs to its length (greedy, no stop token). A model, not a
measurement: it shows how trace length and max_batch move the throughput ratio."""

import os
import sys

import numpy as np

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]
from serve_bench import make_trace, static_batches  # noqa: E402

from jax_flash.serve.pages import PagePool  # noqa: E402
from jax_flash.serve.request import Request, SamplingParams  # noqa: E402
from jax_flash.serve.scheduler import Scheduler  # noqa: E402

VOCAB = 128256


def trace(n, rate, seed=0, prompt_len=(64, 1024), output_len=(16, 512)):
    return make_trace(np.random.default_rng(seed), n, rate, prompt_len, output_len, VOCAB)


def engine(
    tr,
    num_pages=1024,
    P=16,
    max_batch=48,
    rows=1,
    chunk=512,
    dstep=1.60,
    per_row=0.004,
    per_place=0.0062,
):
    pool = PagePool(num_pages)
    s = Scheduler(pool, P, max_batch=max_batch, max_prefill_rows=rows, prefill_chunk=chunk)
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
    t, toks = 0.0, 0
    for idx in static_batches(tr, num_pages, P, max_batch):
        batch = [tr[i] for i in idx]
        start = max(t, max(r["arrival"] for r in batch))
        prefill = sum(len(r["prompt"]) for r in batch) * per_tok
        t = start + (prefill + (max(r["max_new"] for r in batch) - 1) * dstep) / 1e3
        toks += sum(r["max_new"] for r in batch)
    return toks / t, t


def main():
    for n in (48, 128, 256, 512):
        for seed in (0, 1):
            tr = trace(n, 100.0, seed)
            for mb in (16, 48):
                e, steps, te, pre = engine(tr, max_batch=mb)
                st, ts = static(tr, max_batch=mb)
                print(
                    f"{n} requests at 100/s, seed {seed}, max_batch {mb}: engine {e:.0f} tok/s "
                    f"({steps} steps, {te:.2f} s, {pre} preemptions), static {st:.0f} tok/s "
                    f"({ts:.2f} s): {e / st:.2f}x"
                )


if __name__ == "__main__":
    main()
