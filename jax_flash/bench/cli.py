"""Benchmarks of jax_flash against its peers, measured in one process on one device.

    python -m jax_flash.bench prefill [--grid quick|full] [--dtype bfloat16 ...] [--out DIR]
    python -m jax_flash.bench decode  [--grid quick|full] [--dtype bfloat16 ...] [--out DIR]
    python -m jax_flash.bench backward [--grid quick|full] [--dtype bfloat16 ...] [--out DIR]

Each row times jax_flash and the peers available on the device on the same fresh random inputs:
prefill on GPU `jax.nn.dot_product_attention` with implementation "cudnn" and "xla", JAX Pallas
(Triton) `mha`, and the jnp reference; on CPU the jnp reference and
`jax.nn.dot_product_attention(implementation="xla")`. Decode: JAX Pallas `paged_attention` (best
of k_splits 1/4/16, on the same cache in its head-major layout), cuDNN on a contiguous copy of
the cache (bf16/fp16 only) and the jnp gather path. Backward: forward + vjp w.r.t. q, k, v
(TFLOP/s counting 3.5x the forward FLOPs) for jax_flash fast and deterministic, cuDNN, the FA3
binding, Pallas Triton `mha` and tokamax (Mosaic) where they import. Peers that would not fit
in memory are skipped with the reason. Every result also gets its relative error against the
float32 reference on the same inputs (where the reference fits).

Timing (every implementation alike): n chained calls inside one jitted loop, the figure being
the slope between loops of n and n // 5 calls (jax_flash/bench/timing.py). Each row also times
the loop with a trivial body ("harness"): an upper bound on what the chaining adds to a call.

The table is printed; the run's JSON (device, versions, rooflines, rows) and a PNG plot are
saved to --out (default: bench-results/ in the working directory), and their paths printed.
"""

from __future__ import annotations

import argparse

from jax_flash.bench import backward, decode, prefill, save

# The benchmarks `python -m jax_flash.bench NAME` runs: each a module with its grid of shapes and
# a run(grid, dtypes, out_dir, shapes=None, skip=()) that prints and saves its result.
BENCHMARKS = {
    "prefill": prefill.run_prefill,
    "decode": decode.run_decode,
    "backward": backward.run_backward,
}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m jax_flash.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("which", choices=list(BENCHMARKS))
    parser.add_argument(
        "--grid",
        choices=["quick", "full", "peers"],
        default="quick",
        help="peers (prefill only): the D64/128/256 GQA rows compared with cuDNN, FA3, tokamax",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["bfloat16"],
        help="prefill: the dtypes of the grid; decode: the query/cache dtypes of the base grid "
        "(the first also the centre of the one-axis variations, int8/fp8 caches included)",
    )
    parser.add_argument(
        "--out",
        default=save.DEFAULT_OUT,
        metavar="DIR",
        help=f"folder for the run's JSON and PNG (default: {save.DEFAULT_OUT})",
    )
    parser.add_argument("--no-save", action="store_true", help="print only, write no files")
    parser.add_argument(
        "--skip",
        nargs="+",
        default=[],
        metavar="PEER",
        help="peers not to run (a name or a prefix: xla_dpa, pallas, cudnn, jnp_gather, ...)",
    )
    args = parser.parse_args(argv)
    out = None if args.no_save else args.out
    BENCHMARKS[args.which](args.grid, tuple(args.dtype), out, skip=tuple(args.skip))
