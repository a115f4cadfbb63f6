"""The serving benchmark's trace simulated: the engine's own `Scheduler` (admission, pages,
preemption, chunked prefill) stepped by a step-time model instead of a device, against static
batching as benchmarks/serve_bench.py runs it. No JAX device work; runs in seconds on a CPU.

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_flash.nn import pages_needed  # noqa: E402
from jax_flash.serve.pages import PagePool  # noqa: E402
from jax_flash.serve.request import Request, SamplingParams  # noqa: E402
from jax_flash.serve.scheduler import Scheduler  # noqa: E402


def trace(n, rate, seed=0, plen=(64, 1024), olen=(16, 512)):
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1 / rate, n)) if rate > 0 else np.zeros(n)
    pl = rng.integers(plen[0], plen[1] + 1, n)
    ol = rng.integers(olen[0], olen[1] + 1, n)
    return [(float(a), int(p), int(o)) for a, p, o in zip(arr, pl, ol, strict=True)]


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
        Request(i, list(range(1, p + 1)), o, frozenset(), SamplingParams(), a)
        for i, (a, p, o) in enumerate(tr)
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
    return toks / (t - tr[0][0]), steps, t, s.stats.preemptions


def static(tr, num_pages=1024, P=16, max_batch=48, dstep=1.66, per_tok=0.0062):
    t, i, toks = 0.0, 0, 0
    while i < len(tr):
        j, used = i, 0
        while j < len(tr) and j - i < max_batch:
            need = pages_needed(tr[j][1] + tr[j][2] - 1, P)
            if used + need > num_pages - 1:
                break
            used += need
            j += 1
        batch = tr[i:j]
        start = max(t, max(a for a, _, _ in batch))
        t = (
            start
            + (sum(p for _, p, _ in batch) * per_tok + (max(o for _, _, o in batch) - 1) * dstep)
            / 1e3
        )
        toks += sum(o for _, _, o in batch)
        i = j
    return toks / (t - tr[0][0]), t


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
