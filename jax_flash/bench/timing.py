"""How one call is timed: the one timing method every benchmark and tool uses.

n calls of fn run inside one jitted `lax.fori_loop`, each call's inputs depending on the previous
call's output through a one-element in-place update (so no call is hoisted, merged or skipped,
and host dispatch and synchronisation stay out of the per-call time). On a GPU the loop is
compiled so that XLA runs each iteration's kernels as one CUDA graph, as it does a model's
step (LOOP_COMPILER_OPTIONS): by default XLA graphs only runs of 5 or more graphable ops, so the
few kernels of a one-call body would each be launched from the host, 5-8 us apart on an H100,
which counts launch gaps in place of kernel time for short calls (decode) and penalises an
implementation of one kernel against one of several (measured: jax_flash 1 x 8k paged decode,
17.9 us per call with its 9.8 + 2-4 us kernels). A run of the loop also has
a fixed cost besides its calls (dispatch, copies of the chained inputs, synchronisation: ~0.5 ms
on an H100, varying by tenths of a ms), so from 10 calls on the figure is the slope between loops
of n and n // 5 calls, timed in alternation, the median over the pairs (the steady-state time of
one call, as in a decode loop), else the median run time divided by n.

Public: `loop_time` (fn, args, n), `auto_loop_time` (n picked for a target run length),
`pick_n`, `harness_time`, `scaled_loop_time`, and `median_of_runs` for work that times its own
phases (a whole generation), where no chained loop applies.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

# XLA options of the timing loops: every op run of an iteration in one CUDA graph (GPU).
LOOP_COMPILER_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}

METHOD = (
    "n chained calls in one jitted fori_loop (each iteration one CUDA graph on GPU): median "
    "over alternating runs of the slope between n and n // 5 calls (n >= 10), else median "
    "run time / n"
)


def _corner(x):
    """x's first element, as an array of x's rank."""
    return jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)


def _flag(out):
    """A bool scalar from the first element of out's first leaf that XLA cannot fold: NaN for a
    float output, the dtype's minimum for an integer one (token ids, indices). False in
    practice."""
    x = jax.tree.leaves(out)[0].reshape(-1)[0]
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.isnan(x)
    if x.dtype == jnp.bool_:
        return x
    return x == jnp.iinfo(x.dtype).min


def _bump(x, first, flag):
    """x with its first element set to `first` (x's original first element, a loop invariant)
    plus `flag` (a bool from the last call's output: False unless that was NaN), added on the
    bits. The update is a data dependency on the last call that costs one element: it does not
    read x, so XLA updates x in place (the in-place update of a fusion rooted at a
    dynamic-update-slice whose operand has no other reader), and it cannot prove the flag
    False, so nothing is folded away."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        first = jax.lax.bitcast_convert_type(first, bits) + flag.astype(bits)
        first = jax.lax.bitcast_convert_type(first, x.dtype)
    else:
        first = first + flag.astype(x.dtype)
    return jax.lax.dynamic_update_slice(x, first, (0,) * x.ndim)


def chained_loop(fn, args, n: int, chain):
    """jit of: n calls of fn(*args) in one fori_loop, the args at positions `chain` bumped by
    each call's output before the next call; returns the last call's output (loop-carried, so
    it is written where the loop keeps it, with no copy). The other args are loop invariants
    (read-only: not copied)."""
    chain = tuple(chain)
    out = jax.eval_shape(fn, *args)

    def run(*args):
        firsts = [_corner(args[i]) for i in chain]

        def body(_, carry):
            xs, _ = carry
            a = list(args)
            for i, x in zip(chain, xs, strict=True):
                a[i] = x
            o = fn(*a)
            flag = _flag(o)
            return tuple(_bump(x, f, flag) for x, f in zip(xs, firsts, strict=True)), o

        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)
        init = (tuple(args[i] for i in chain), zeros)
        return jax.lax.fori_loop(0, n, body, init)[1]

    return jax.jit(run, compiler_options=LOOP_COMPILER_OPTIONS)


def _runs_time(loop, args, runs: int) -> float:
    """Median seconds of `runs` synchronised calls of an already compiled and warmed-up loop."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append(time.perf_counter() - t0)
        if len(times) >= 3 and sum(times) > 1.0:  # slow peers: fewer runs
            break
    return float(np.median(times))


def slope_time(make_loop, args, n: int, runs: int):
    """(seconds per call, last output) of loops of n chained calls (make_loop(n) -> jitted loop).
    Each run of a loop has a fixed cost besides its calls (dispatch, copies of the chained args,
    the output's zero fill, the final synchronisation: ~0.5 ms on an H100, give or take a few
    tenths of a ms from run to run), which a short loop would spread over its calls; from
    n >= 10 calls the time is the slope between a loop of n calls and one of n // 5, run in
    alternation (a long run, then a short one), the median over the pairs (the steady-state
    time of one call, as in a generate loop). Below 10 calls (CPU, slow peers): the run's
    time / n."""
    loop = make_loop(n)
    out = jax.block_until_ready(loop(*args))
    if n < 10:
        return _runs_time(loop, args, runs) / n, out
    small = n // 5
    short = make_loop(small)
    jax.block_until_ready(short(*args))
    slopes = []
    spent = 0.0
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        t1 = time.perf_counter()
        jax.block_until_ready(short(*args))
        t2 = time.perf_counter()
        slopes.append(((t1 - t0) - (t2 - t1)) / (n - small))
        spent += t2 - t0
        if len(slopes) >= 3 and spent > 2.0:  # slow peers: fewer pairs
            break
    return max(float(np.median(slopes)), 0.0), out


def loop_time(fn, args, *, n: int, chain, runs: int = 5):
    """(seconds per call, last output): n chained calls of fn(*args) inside one jitted
    fori_loop (see chained_loop), compiled and warmed up by a first run; see slope_time.
    `chain`: positions of the args each call's output feeds into (at least one, not a PRNG key
    array)."""
    return slope_time(lambda m: chained_loop(fn, args, m, chain), args, n, runs)


def pick_n(t_pred: float, target: float, n_min: int, n_max: int) -> int:
    """Calls per loop run so that one run lasts about `target` seconds."""
    return int(min(n_max, max(n_min, math.ceil(target / max(t_pred, 1e-7)))))


def auto_loop_time(fn, args, *, chain, target: float = 0.05, n_max: int = 5000):
    """loop_time with n picked so that one run lasts about `target` seconds, from a first loop
    of 10 calls (which also compiles fn)."""
    first, _ = loop_time(fn, args, n=10, chain=chain, runs=3)
    return loop_time(fn, args, n=pick_n(first, target, 10, n_max), chain=chain)


def harness_time(args, chain, n: int) -> float:
    """Seconds per iteration of the timing loop with a trivial body (one-element reads of the
    chained args in place of the call): an upper bound on what the dependency between calls
    adds to each call (on GPU its launches overlap the real call's kernels)."""

    def trivial(*a):  # reads one element of each chained arg, so that none is dead
        return jnp.stack([_corner(a[i]).reshape(()).astype(jnp.float32) for i in chain])

    t, _ = loop_time(trivial, args, n=n, chain=chain, runs=3)
    return t


def scaled_loop_time(f, x, n: int) -> float:
    """Seconds per call of f(x, c) with c a loop-carried scalar (always 1): each call reads all
    of x and writes its output, and the read-only x is never copied (see slope_time)."""

    def make(m):
        def run(x):
            def body(_, carry):
                c, _ = carry
                o = f(x, c)
                return c + jnp.isnan(o.reshape(-1)[0]).astype(c.dtype), o

            one = jnp.ones((), jnp.float32)
            o = jax.eval_shape(f, x, one)
            return jax.lax.fori_loop(0, m, body, (one, jnp.zeros(o.shape, o.dtype)))

        return jax.jit(run, compiler_options=LOOP_COMPILER_OPTIONS)

    return slope_time(make, (x,), n, runs=5)[0]


def median_of_runs(run, repeats: int):
    """For work that times its own phases (a whole generation with a host loop, where no chained
    loop applies): run() -> (result, seconds, seconds, ...) is called once to compile and warm
    up, then `repeats` times; returns (the last result, the median of each seconds field)."""
    run()
    runs = [run() for _ in range(repeats)]
    return runs[-1][0], *(float(np.median(col)) for col in zip(*(r[1:] for r in runs), strict=True))
