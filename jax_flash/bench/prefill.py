"""The prefill grid (dense attention over [B, S, H, D]) and its run: every shape timed for
jax_flash and its peers on the same fresh random inputs, in TFLOP/s (causal counts half the
FLOPs), each with its error against the float32 reference where that fits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import reference
from jax_flash.bench import report, timing
from jax_flash.bench.peers import MATERIALISING, prefill_peers, skipped
from jax_flash.bench.run import Run
from jax_flash.bench.shapes import PrefillShape


def grid_shapes(name: str, device_kind: str, dtypes) -> list[PrefillShape]:
    if device_kind != "gpu":
        sizes = [(1, 512), (1, 2048)] if name == "quick" else [(1, 512), (1, 2048), (1, 4096)]
        return [
            PrefillShape(b, s, 8, h_kv, 128, causal, dt)
            for dt in dtypes
            for (b, s) in sizes
            for h_kv in (8, 2)
            for causal in (True, False)
        ]
    if name == "peers":
        # The rows compared with cuDNN, the FlashAttention-3 binding and tokamax: D128 GQA-4 at
        # 16 x 1k, 4 x 4k and 2 x 8k; D64 and D256 at 4 x 4k.
        sizes = [(128, 16, 1024), (128, 4, 4096), (128, 2, 8192), (64, 4, 4096), (256, 4, 4096)]
        return [
            PrefillShape(b, seqlen, 32, 8, d, causal, dt)
            for dt in dtypes
            for d, b, seqlen in sizes
            for causal in (True, False)
        ]
    if name == "quick":
        return [
            PrefillShape(4, 4096, 32, 8, 128, causal, dt)
            for dt in dtypes
            for causal in (True, False)
        ]
    # 54 rows per dtype: GQA-4 at every S, MHA at 1k, 4k and 16k; 16k tokens per row.
    heads_seqlens = (
        ((32, 8), (512, 1024, 2048, 4096, 8192, 16384)),
        ((32, 32), (1024, 4096, 16384)),
    )
    shapes = []
    for dt in dtypes:
        for d in (64, 128, 256):
            for (hq, hkv), seqlens in heads_seqlens:
                for seqlen in seqlens:
                    batch = max(1, 16384 // seqlen)
                    for causal in (True, False):
                        shapes.append(PrefillShape(batch, seqlen, hq, hkv, d, causal, dt))
    return shapes


def _calls(kind, name, s: PrefillShape, roof) -> int:
    """Calls per loop run, from the expected rate of this kind of implementation."""
    slow = name in MATERIALISING
    if kind == "gpu":
        rate = roof.get("bf16_matmul_tflops", 700.0) * 1e12 * (0.06 if slow else 0.5)
        return timing.pick_n(s.flops / rate, 0.04, 2, 200)
    rate = 1e11 * (0.3 if slow else 1.0)
    return timing.pick_n(s.flops / rate, 0.01, 1, 3)


def run_prefill(
    grid="quick",
    dtypes=("bfloat16",),
    out_dir=None,
    reference_limit=4096,
    shapes=None,
    skip=(),
):
    """Times the grid (or `shapes`), prints a line per peer and the table; with `out_dir`,
    writes the run's JSON and PNG there. Returns the result dict (as saved)."""
    run = Run("prefill", grid, out_dir)
    kind, mem, roof = run.kind, run.mem, run.roof
    shapes = grid_shapes(grid, kind, dtypes) if shapes is None else list(shapes)
    for i, s in run.shapes(shapes):
        dtype = jnp.dtype(s.dtype)
        keys = jax.random.split(jax.random.key(1000 + i), 3)
        q = jax.random.normal(keys[0], (s.batch, s.seqlen, s.heads_q, s.head_dim), dtype)
        k = jax.random.normal(keys[1], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
        v = jax.random.normal(keys[2], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
        fits = s.scores_bytes < 0.5 * mem
        ref = None
        if s.seqlen <= reference_limit and fits:
            try:
                f32 = [x.astype(jnp.float32) for x in (q, k, v)]
                ref = jax.jit(functools.partial(reference.attention, causal=s.causal))(*f32)
                ref = np.asarray(ref)
                del f32
            except Exception as e:  # no reference: results without rel_err
                print(f"    (no float32 reference: {report.error_text(e)})", flush=True)
        row = {"shape": dataclasses.asdict(s), "results": {}}
        row["harness_us"] = run.harness_us((q, k, v), (0, 1, 2))
        for name, fn in prefill_peers(kind, s).items():
            if skipped(name, skip):
                continue
            if name in MATERIALISING and not fits:
                res = {
                    "error": f"skipped: the S x S scores need ~{s.scores_bytes / 2**30:.0f} GiB "
                    f"(over half of the {mem / 2**30:.0f} GiB this process may allocate)"
                }
            else:
                try:
                    n = _calls(kind, name, s, roof)
                    t, out = timing.loop_time(fn, (q, k, v), n=n, chain=(0, 1, 2))
                    res = {"ms": t * 1e3, "tflops": s.flops / t / 1e12, "n": n}
                    if ref is not None:
                        res["rel_err"] = report.rel_err(out, ref)
                    del out
                except Exception as e:  # a peer that cannot run this shape (OOM, unsupported)
                    res = {"error": report.error_text(e)}
            row["results"][name] = res
            report.prefill_line(name, res)
        run.add(row)
        del q, k, v, ref
    report.prefill_table(run.rows, kind)
    return run.finish()
