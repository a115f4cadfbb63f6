"""The backward grid (forward + backward of dense attention over [B, S, H, D]) and its run:
every shape timed for jax_flash (fast and deterministic) and its peers on the same fresh random
inputs. One call is the forward and the vjp w.r.t. q, k and v for a random cotangent of o, in
TFLOP/s counting 3.5x the forward's FLOPs (forward 1x, backward 2.5x; causal counts half), each
with its error against the float32 reference where that fits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import reference
from jax_flash.bench import report, timing
from jax_flash.bench.peers import backward_peers, skipped
from jax_flash.bench.run import Run
from jax_flash.bench.shapes import PrefillShape

FWD_BWD_FLOPS = 3.5  # forward + backward FLOPs per forward FLOP


def grid_shapes(name: str, device_kind: str, dtypes) -> list[PrefillShape]:
    if device_kind != "gpu":
        return [
            PrefillShape(1, s, 8, 2, 64, causal, dt)
            for dt in dtypes
            for s in (256, 1024)
            for causal in (True, False)
        ]
    rows = [(4, 4096, 128), (1, 16384, 128)]
    if name == "full":
        rows += [(4, 4096, 64), (4, 4096, 256)]
    return [
        PrefillShape(b, s, 32, 8, d, causal, dt)
        for dt in dtypes
        for (b, s, d) in rows
        for causal in (True, False)
    ]


def fwd_bwd(f):
    """(q, k, v, do) -> (dq, dk, dv): the forward of f and its vjp for cotangent do."""

    def run(q, k, v, do):
        _, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    return run


def _calls(kind, s: PrefillShape, roof) -> int:
    flops = FWD_BWD_FLOPS * s.flops
    if kind == "gpu":
        rate = roof.get("bf16_matmul_tflops", 700.0) * 1e12 * 0.4
        return timing.pick_n(flops / rate, 0.1, 10, 100)
    return timing.pick_n(flops / 1e11, 0.01, 1, 3)


def _rel_errs(out, ref) -> float:
    """The largest relative error of dq, dk, dv."""
    return max(report.rel_err(o, r) for o, r in zip(out, ref, strict=True))


def run_backward(grid="quick", dtypes=("bfloat16",), out_dir=None, reference_limit=2048,
                 shapes=None, skip=()):  # fmt: skip
    """Times the grid (or `shapes`), prints a line per peer and the table; with `out_dir`,
    writes the run's JSON (and PNG) there. Returns the result dict (as saved)."""
    run = Run("backward", grid, out_dir)
    kind, mem, roof = run.kind, run.mem, run.roof
    shapes = grid_shapes(grid, kind, dtypes) if shapes is None else list(shapes)
    for i, s in run.shapes(shapes):
        dtype = jnp.dtype(s.dtype)
        keys = jax.random.split(jax.random.key(2000 + i), 4)
        q = jax.random.normal(keys[0], (s.batch, s.seqlen, s.heads_q, s.head_dim), dtype)
        k = jax.random.normal(keys[1], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
        v = jax.random.normal(keys[2], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
        do = jax.random.normal(keys[3], q.shape, dtype)
        ref = None
        if s.seqlen <= reference_limit and 3 * s.scores_bytes < 0.5 * mem:
            try:
                f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
                attn = functools.partial(reference.attention, causal=s.causal)
                ref = [np.asarray(x) for x in jax.jit(fwd_bwd(attn))(*f32)]
                del f32
            except Exception as e:  # no reference: results without rel_err
                print(f"    (no float32 reference: {report.error_text(e)})", flush=True)
        row = {"shape": dataclasses.asdict(s), "results": {}}
        row["harness_us"] = run.harness_us((q, k, v, do), (0, 1, 2))
        for name, fn in backward_peers(kind, s).items():
            if skipped(name, skip):
                continue
            if isinstance(fn, str):
                res = {"error": fn}
            else:
                try:
                    n = _calls(kind, s, roof)
                    t, out = timing.loop_time(fwd_bwd(fn), (q, k, v, do), n=n, chain=(0, 1, 2))
                    res = {"ms": t * 1e3, "tflops": FWD_BWD_FLOPS * s.flops / t / 1e12, "n": n}
                    if ref is not None:
                        res["rel_err"] = _rel_errs(out, ref)
                    del out
                except Exception as e:  # a peer that cannot run this shape (OOM, unsupported)
                    res = {"error": report.error_text(e)}
            row["results"][name] = res
            report.prefill_line(name, res)
        run.add(row)
        del q, k, v, do, ref
    report.prefill_table(run.rows, kind)
    return run.finish(flops_note="fwd+bwd TFLOP/s count 3.5x the forward FLOPs; causal half")
