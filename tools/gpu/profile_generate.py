"""Where a `generate` decode step spends its GPU time: the kernels of one traced `generate` call
(jax.profiler, read back with jax.profiler.ProfileData; no other tool needed), summed by name,
with the idle gaps between consecutive kernels of a stretch of the decode loop.

    python tools/gpu/profile_generate.py [--batch 1] [--prompt-len 2048] [--new-tokens 32]
                                         [--top 30] [--gaps 60] [--tiny]

The model is `benchmarks/e2e_bench.py`'s random-weight 1.24B Llama-3.2-1B-shaped decoder in
bf16 (--tiny: its small test model, to check the tool on a CPU). The decode tokens/s printed
first is `generate`'s own (median of 3 runs after a compiling one, 128 new tokens); the trace is
of one further call with --new-tokens, so per-step figures divide by --new-tokens - 1 (the
prefill's kernels are in the sums too: the few large ones, e.g. the Hopper prefill kernel, once
per layer). Used for docs/serving.md's profile of the batch-1 step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

import jax
import numpy as np
from jax.profiler import ProfileData

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from e2e_bench import LLAMA_1B, TINY  # noqa: E402

from jax_flash.models import LlamaForCausalLM, generate  # noqa: E402


def gpu_kernels(trace_dir: str) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of every event on the GPU planes' stream lines, by start."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    events = []
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    return sorted(events)


def busy_ns(events) -> float:
    """Length of the union of the events' intervals (kernels may overlap)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, d, _ in events:
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, s + d
        else:
            cur_e = max(cur_e, s + d)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", type=int, default=60)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()

    config = TINY if args.tiny else LLAMA_1B
    model = LlamaForCausalLM.random(config, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (args.batch, args.prompt_len)).tolist()
    generate(model, prompts, 128)
    tps = float(np.median([generate(model, prompts, 128).decode_tokens_per_s for _ in range(3)]))
    print(f"B={args.batch}: decode {tps:.0f} tokens/s, {1e3 * args.batch / tps:.3f} ms a step")

    generate(model, prompts, args.new_tokens)  # compiles the traced call's shapes
    with tempfile.TemporaryDirectory() as tdir:
        with jax.profiler.trace(tdir):
            generate(model, prompts, args.new_tokens)
        events = gpu_kernels(tdir)
    if not events:
        sys.exit("no GPU kernels in the trace (no GPU, or the profiler saw none)")
    steps = max(1, args.new_tokens - 1)
    span = max(s + d for s, d, _ in events) - events[0][0]
    print(
        f"{len(events)} kernels, span {span / 1e3:.0f} us, busy {busy_ns(events) / 1e3:.0f} us; "
        f"per decode step ~{len(events) / steps:.0f} kernels, {busy_ns(events) / steps / 1e3:.0f} "
        "us busy"
    )
    by_name = collections.defaultdict(lambda: [0, 0])
    for _, d, name in events:
        by_name[name][0] += 1
        by_name[name][1] += d
    print(f"{'us total':>10} {'calls':>6} {'us each':>8}  kernel")
    for name, (n, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[: args.top]:
        print(f"{t / 1e3:10.1f} {n:6d} {t / n / 1e3:8.2f}  {name[:100]}")
    print("a stretch of the decode loop (gap: idle us before the kernel):")
    mid = len(events) // 2
    prev = None
    for s, d, name in events[mid : mid + args.gaps]:
        gap = 0.0 if prev is None else (s - prev) / 1e3
        print(f"  gap {gap:7.2f}  {d / 1e3:7.2f} us  {name[:90]}")
        prev = s + d if prev is None else max(prev, s + d)


if __name__ == "__main__":
    main()
