"""jax_flash.bench: benchmarks of jax_flash against its peers (`python -m jax_flash.bench`, see
cli.py), and the timing helpers every benchmark and tool uses.

One job per module:
    timing   how one call is timed (chained calls in one jitted loop, slope between lengths)
    device   versions, memory and measured rooflines of the device
    shapes   a row's shape per benchmark: sizes, work done, label
    prefill  the prefill grid and its run
    decode   the paged-decode grid, its paged inputs and its run
    backward the forward + backward grid and its run
    run      the frame both runs share: device, progress, rows saved as they come, result
    peers    the implementations compared with jax_flash
    report   progress lines, tables and summaries (only what was measured)
    save     the run's JSON and PNG files (plot: the plots)
    cli      the command line and the registry of benchmarks
"""

from jax_flash.bench.backward import run_backward
from jax_flash.bench.cli import BENCHMARKS, main
from jax_flash.bench.decode import CHAIN as DECODE_CHAIN
from jax_flash.bench.decode import make_paged, run_decode
from jax_flash.bench.prefill import run_prefill
from jax_flash.bench.save import DEFAULT_OUT
from jax_flash.bench.shapes import DecodeShape, PrefillShape
from jax_flash.bench.timing import (
    auto_loop_time,
    harness_time,
    loop_time,
    median_of_runs,
    pick_n,
)

__all__ = [
    "BENCHMARKS",
    "DECODE_CHAIN",
    "DEFAULT_OUT",
    "DecodeShape",
    "PrefillShape",
    "auto_loop_time",
    "harness_time",
    "loop_time",
    "main",
    "make_paged",
    "median_of_runs",
    "pick_n",
    "run_backward",
    "run_decode",
    "run_prefill",
]
