"""Where the serving engine's step time goes: the serving benchmark's uniform trace through an
`Engine`, with the host time of each phase of `Engine.step` per step (the scheduler, packing the
step's inputs, the jit dispatch beyond the packing, the wait for the device, reading the drawn
tokens back), the steps' shapes, and the device time of a full decode step replayed alone.

    python tools/gpu/profile_engine_step.py            # the 1.24B bf16 model, on a GPU
    python tools/gpu/profile_engine_step.py --tiny     # a small model and trace, on CPU

When the host phases add up to more than the replayed step, the engine is host-bound: the
device waits for Python between steps (docs/serving.md, "Measured with the reserve").
"""

from __future__ import annotations

import argparse
import collections
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
from jax_flash.serve import engine as engine_module  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model and trace (CPU)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=48)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--decode-steps", type=int, default=1, help="Engine's decode_steps")
    args = parser.parse_args(argv)
    tiny = args.tiny
    config = sb.TINY if tiny else sb.LLAMA_1B
    model = sb.random_model(config, 0)
    mb = args.max_batch
    lengths = (
        sb.UniformLengths((4, 40), (2, 24)) if tiny else sb.UniformLengths((64, 1024), (16, 512))
    )
    engine = Engine(
        model,
        decode_buckets=[min(MIN_DECODE_ROWS, mb)],
        num_pages=256 if tiny else 1024,
        page_size=16,
        max_batch=mb,
        prefill_chunk=16 if tiny else 512,
        max_seq_len=128 if tiny else 2048,
        decode_steps=args.decode_steps,
    )
    print(f"{jax.devices()[0].device_kind}: compiled in {engine.warmup(sampling=False):.1f} s")

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
        if (
            shape.num_decode == mb
            and not shape.num_chunks
            and shape.steps == args.decode_steps
            and len(plan.decode) > mb // 4
        ):
            full_step.setdefault("args", engine._step_args(shape, plan))
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
    trace = sb.make_trace(
        np.random.default_rng(0), args.requests, 100.0, lengths, config.vocab_size
    )
    t0 = time.perf_counter()
    summary, _, _ = sb.run_engine(engine, trace, "engine")
    wall = time.perf_counter() - t0
    steps = sum(shapes.values())
    print(
        f"{summary['throughput_tokens_per_s']:.0f} tokens/s, time between tokens p50 "
        f"{summary['tbt_p50_ms']:.2f} ms; {steps} dispatches, {1e3 * wall / steps:.3f} ms each"
    )
    for name, seconds in host.items():
        print(f"  {name:26s} {1e3 * seconds / steps:7.3f} ms a dispatch")
    for name, n in sorted(shapes.items()):
        print(f"  {name}: {n} dispatches")
    if "args" in full_step:
        static, shape, params, _, previous, ints, floats = full_step["args"]
        step = engine_module._device_step
        if shape.steps > 1:
            step = engine_module._device_decode_steps
        kv = engine._kv
        for i in range(3 + args.replays):
            if i == 3:
                jax.block_until_ready(kv)
                t = time.perf_counter()
            *outs, kv = step(static, shape, params, kv, previous, ints, floats)
        jax.block_until_ready(kv)
        engine._kv = kv
        ms = 1e3 * (time.perf_counter() - t) / args.replays
        print(
            f"  a dispatch of {shape.steps} {mb}-row decode step(s) replayed alone: {ms:.3f} ms "
            f"({ms / shape.steps:.3f} ms a step)"
        )


if __name__ == "__main__":
    main()
