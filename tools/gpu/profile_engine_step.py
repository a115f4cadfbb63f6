"""Where the serving engine's step time goes: the serving benchmark's uniform trace through an
`Engine`, with the host time of each phase of `Engine.step` per step (the scheduler, packing the
step's inputs, the jit dispatch beyond the packing, the wait for the device, reading the drawn
tokens back), the steps' shapes, and the device time of a full decode step replayed alone.

    python tools/gpu/profile_engine_step.py            # the 1.24B bf16 model, on a GPU
    python tools/gpu/profile_engine_step.py --tiny     # a small model and trace, on CPU
    python tools/gpu/profile_engine_step.py --decode-steps 1 4 --rounds 3 --json out.json

When the host phases add up to more than the replayed step, the engine is host-bound: the
device waits for Python between steps (docs/serving.md, "Measured with the reserve").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import jax
import numpy as np

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
import serve_bench as sb  # noqa: E402

from jax_flash.nn import MIN_DECODE_ROWS  # noqa: E402
from jax_flash.serve import Engine  # noqa: E402
from jax_flash.serve.device_step import run_decode_steps, run_step  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model and trace (CPU)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=48)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument(
        "--decode-steps",
        type=int,
        nargs="+",
        default=[1],
        help="Engine's decode_steps; several: alternated in one process (--rounds each)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="also write the rounds to this JSON file")
    args = parser.parse_args(argv)
    tiny = args.tiny
    config = sb.TINY if tiny else sb.LLAMA_1B
    model = sb.random_model(config, 0)
    mb = args.max_batch
    lengths = (
        sb.UniformLengths((4, 40), (2, 24)) if tiny else sb.UniformLengths((64, 1024), (16, 512))
    )
    # One engine for every round: compiled with the largest decode_steps (which also compiles
    # the one-step executables), the scheduler's value switched between rounds.
    engine = Engine(
        model,
        decode_buckets=[min(MIN_DECODE_ROWS, mb)],
        num_pages=256 if tiny else 1024,
        page_size=16,
        max_batch=mb,
        prefill_chunk=16 if tiny else 512,
        max_seq_len=128 if tiny else 2048,
        decode_steps=max(args.decode_steps),
    )
    device = jax.devices()[0].device_kind
    print(f"{device}: compiled in {engine.warmup(sampling=False):.1f} s")

    host = collections.defaultdict(float)
    shapes = collections.Counter()
    full_step = {}

    def timed(name, f):
        def run(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            host[name] += time.perf_counter() - t
            return r

        return run

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine._pack = timed("pack inputs", engine._pack)
    call = engine._call

    def dispatch(shape, plan):
        t = time.perf_counter()
        r = call(shape, plan)
        host["dispatch (with packing)"] += time.perf_counter() - t
        shapes[
            f"decode rows {shape.num_decode}, prompt chunks {shape.num_chunks}, steps {shape.steps}"
        ] += 1
        if shape.num_decode == mb and not shape.num_chunks and len(plan.decode) > mb // 4:
            full_step.setdefault(shape.steps, engine._step_args(shape, plan))
        return r

    engine._call = dispatch
    read = engine._read

    def read_tokens(step):
        if step is not None:
            t = time.perf_counter()
            jax.block_until_ready(step[1])
            host["wait for the device"] += time.perf_counter() - t
        t = time.perf_counter()
        r = read(step)
        host["read tokens"] += time.perf_counter() - t
        return r

    engine._read = read_tokens
    rows = []
    for rnd in range(args.rounds):
        for k in args.decode_steps:
            engine.scheduler.decode_steps = k
            host.clear()
            shapes.clear()
            trace = sb.make_trace(
                np.random.default_rng(0), args.requests, 100.0, lengths, config.vocab_size
            )
            t0 = time.perf_counter()
            summary, _, _ = sb.run_engine(engine, trace, "engine")
            wall = time.perf_counter() - t0
            n = sum(shapes.values())
            print(
                f"round {rnd}, decode_steps {k}: {summary['throughput_tokens_per_s']:.0f} "
                f"tokens/s, TPOT p50 {summary['tpot_p50_ms']:.2f} ms, TBT p50 "
                f"{summary['tbt_p50_ms']:.2f} ms; {n} dispatches, {1e3 * wall / n:.3f} ms each"
            )
            for name, seconds in host.items():
                print(f"  {name:26s} {1e3 * seconds / n:7.3f} ms a dispatch")
            for name, count in sorted(shapes.items()):
                print(f"  {name}: {count} dispatches")
            rows.append(
                dict(
                    round=rnd,
                    decode_steps=k,
                    dispatches=n,
                    host_ms_per_dispatch={name: 1e3 * v / n for name, v in host.items()},
                    **summary,
                )
            )
    replays = {}
    for steps, (static, shape, params, _, previous, ints, floats) in sorted(full_step.items()):
        step = run_step if steps == 1 else run_decode_steps
        kv = engine._kv
        for i in range(3 + args.replays):
            if i == 3:
                jax.block_until_ready(kv)
                t = time.perf_counter()
            *_, kv = step(static, shape, params, kv, previous, ints, floats)
        jax.block_until_ready(kv)
        engine._kv = kv
        ms = 1e3 * (time.perf_counter() - t) / args.replays
        replays[steps] = ms
        print(
            f"a dispatch of {steps} {mb}-row decode step(s) replayed alone: {ms:.3f} ms "
            f"({ms / steps:.3f} ms a step)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=device, jax=jax.__version__, args=vars(args) | dict(json=None),
                     rounds=rows, replayed_dispatch_ms=replays),
                f,
                indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
