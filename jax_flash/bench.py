"""Benchmarks of jax_flash against its peers, measured in one process on one device.

    python -m jax_flash.bench prefill [--grid quick|full] [--out DIR] [--dtype bfloat16 ...]
    python -m jax_flash.bench decode  [--grid quick|full] [--out DIR] [--dtype bfloat16 ...]

Each row times jax_flash and the peers available on the device on the same fresh random inputs:
on GPU `jax.nn.dot_product_attention` with implementation "cudnn" and "xla", JAX Pallas
(Triton) `mha`, and the jnp reference; on CPU the jnp reference and
`jax.nn.dot_product_attention(implementation="xla")`. Peers that materialise the S x S scores
are skipped (with the reason) where those would not fit in memory. Every result also gets its
relative error against the float32 reference on the same inputs (where the reference fits).

Timing (every implementation alike): n calls run inside one jitted `lax.fori_loop`, each call's
inputs depending on the previous call's output through a one-element in-place update (so no call
is hoisted, merged or skipped, and host dispatch and synchronisation stay out of the per-call
time). A run of the loop also has a fixed cost besides its calls (dispatch, copies of the
chained inputs, synchronisation: ~0.5 ms on an H100, varying by tenths of a ms), so from 10
calls on the figure is the slope between loops of n and n // 5 calls, timed in alternation, the
median over the pairs (the steady-state time of one call, as in a decode loop), else the median
run time divided by n. n is picked so that one run of the loop lasts tens of ms on GPU (decode:
~100 ms). Each row also times the loop with a trivial body ("harness"): an
upper bound on what the dependency adds to each call. The rooflines (matmul rate, copy and read
bandwidth) are timed the same way.

Decode rows time paged attention over a paged KV cache (random page permutation; int8 and
float8_e4m3fn caches carry per-token-and-head float32 scales, as `append_kv` writes them, or in
the rows marked "/head" one scale per KV head, as a calibrated per-head or per-tensor scale) beside
JAX Pallas `paged_attention` (best of k_splits 1/4/16, on the same cache in its head-major
layout), the jnp gather reference, and cuDNN on a contiguous copy of the cache (the non-paged
bound; bf16/fp16 only). The figure of merit is the effective KV bandwidth: bytes of K and V (and
scales) read / time, also given as % of the measured HBM read bandwidth, and tokens/s
(B * Sq / time).

The table is printed; JSON (with device, versions, rooflines) and a PNG plot go to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform as _platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import reference

_SHORT = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "int8": "int8",
    "float8_e4m3fn": "fp8",
}
_QUANTIZED = ("int8", "float8_e4m3fn")


def _short(dtype: str) -> str:
    return _SHORT.get(dtype, dtype)


def _kilo(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ---------------------------------------------------------------------------------------------
# timing


def _corner(x):
    """x's first element, as an array of x's rank."""
    return jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)


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


def _loop_fn(fn, args, n: int, chain):
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
            flag = jnp.isnan(o.reshape(-1)[0])
            return tuple(_bump(x, f, flag) for x, f in zip(xs, firsts, strict=True)), o

        init = (tuple(args[i] for i in chain), jnp.zeros(out.shape, out.dtype))
        return jax.lax.fori_loop(0, n, body, init)[1]

    return jax.jit(run)


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


def _slope_time(make_loop, args, n: int, runs: int):
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


def _loop_time(fn, args, *, n: int, chain, runs: int = 5):
    """(seconds per call, last output): chained calls of fn inside one jitted fori_loop (see
    _loop_fn), compiled and warmed up by a first run; see _slope_time."""
    return _slope_time(lambda m: _loop_fn(fn, args, m, chain), args, n, runs)


def _pick_n(t_pred: float, target: float, n_min: int, n_max: int) -> int:
    """Calls per loop run so that one run lasts about `target` seconds."""
    return int(min(n_max, max(n_min, math.ceil(target / max(t_pred, 1e-7)))))


def _harness_time(args, chain, n: int) -> float:
    """Seconds per iteration of the timing loop with a trivial body (one-element reads of the
    chained args in place of the call): an upper bound on what the dependency between calls
    adds to each call (on GPU its launches overlap the real call's kernels)."""

    def trivial(*a):  # reads one element of each chained arg, so that none is dead
        return jnp.stack([_corner(a[i]).reshape(()).astype(jnp.float32) for i in chain])

    t, _ = _loop_time(trivial, args, n=n, chain=chain, runs=3)
    return t


def _scaled_loop_time(f, x, n: int) -> float:
    """Seconds per call of f(x, c) with c a loop-carried scalar (always 1): each call reads all
    of x and writes its output, and the read-only x is never copied (see _slope_time)."""

    def make(m):
        def run(x):
            def body(_, carry):
                c, _ = carry
                o = f(x, c)
                return c + jnp.isnan(o.reshape(-1)[0]).astype(c.dtype), o

            one = jnp.ones((), jnp.float32)
            o = jax.eval_shape(f, x, one)
            return jax.lax.fori_loop(0, m, body, (one, jnp.zeros(o.shape, o.dtype)))

        return jax.jit(run)

    return _slope_time(make, (x,), n, runs=5)[0]


def _rooflines(device_kind: str) -> dict:
    """Measured bf16 matmul rate, device-memory copy and read bandwidth of this device (each
    timed inside a loop like the rows)."""
    if device_kind != "gpu":
        return {}
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    t, _ = _loop_time(jnp.matmul, (a, b), n=20, chain=(0,))
    del a, b
    x = jax.random.normal(jax.random.key(3), (1 << 30,), jnp.bfloat16)  # 2 GiB
    tc = _scaled_loop_time(lambda x, c: x * c.astype(x.dtype), x, 20)
    del x
    x = jax.random.normal(jax.random.key(5), (1 << 31,), jnp.bfloat16)  # 4 GiB
    tr = _scaled_loop_time(lambda x, c: jnp.sum(x * c.astype(x.dtype), dtype=jnp.float32), x, 20)
    del x
    return {
        "bf16_matmul_tflops": 2 * n**3 / t / 1e12,
        "hbm_copy_read_plus_write_gbps": 2 * (1 << 30) * 2 / tc / 1e9,
        "hbm_read_gbps": (1 << 31) * 2 / tr / 1e9,
    }


def _print_rooflines(roof: dict):
    if roof:
        print(
            f"# rooflines: bf16 matmul {roof['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"copy {roof['hbm_copy_read_plus_write_gbps']:.0f} GB/s (read+write), "
            f"read {roof['hbm_read_gbps']:.0f} GB/s (jnp.sum of 4 GiB)",
            flush=True,
        )


def _mem_limit(device) -> float:
    """Bytes this process may allocate on the device (16 GiB where the device does not say)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = {}
    return float(stats.get("bytes_limit", 16 << 30))


def _rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _error(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:200]}"


def _device_info(device) -> dict:
    info = {
        "device": str(device.device_kind),
        "platform": device.platform,
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "jax_flash": jax_flash.__version__,
        "python": sys.version.split()[0],
        "host": _platform.node(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "timing": (
            "n chained calls in one jitted fori_loop: median over alternating runs of the slope "
            "between n and n // 5 calls (n >= 10), else median run time / n"
        ),
    }
    if device.platform == "gpu":
        try:
            import subprocess

            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def _skipped(name: str, skip) -> bool:
    """Whether --skip names this peer (or a prefix of its name: "pallas" skips pallas_k*)."""
    return name != "jax_flash" and any(name.startswith(x) for x in skip)


def _progress(i, total, t_start, label):
    print(f"[{i + 1}/{total} {time.perf_counter() - t_start:4.0f}s] {label}", flush=True)


def _start(grid):
    device = jax.devices()[0]
    kind = "gpu" if device.platform == "gpu" else "cpu"
    info = _device_info(device)
    info["grid"] = grid
    print(f"# device: {info['device']} ({kind}), jax {info['jax']}", flush=True)
    roof = _rooflines(kind)
    _print_rooflines(roof)
    return device, kind, info, roof


# ---------------------------------------------------------------------------------------------
# prefill


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str

    @property
    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads_q * self.seqlen * self.seqlen * self.head_dim
        return f / 2 if self.causal else f

    @property
    def scores_bytes(self) -> float:
        """Memory a jnp/XLA attention that materialises the scores needs (float32 scores and
        about two temporaries of their size)."""
        return 3.0 * self.batch * self.heads_q * self.seqlen * self.seqlen * 4

    def label(self) -> str:
        c = "causal" if self.causal else "full"
        return (
            f"{_short(self.dtype)} B{self.batch} S{_kilo(self.seqlen)} "
            f"H{self.heads_q}/{self.heads_kv} D{self.head_dim} {c}"
        )


_MATERIALISING = ("xla_dpa", "jnp_reference")  # peers that build the S x S scores


def _peers(device_kind: str, s: PrefillShape):
    """name -> fn(q, k, v) for every implementation that applies on this platform."""
    peers = {
        "jax_flash": functools.partial(jax_flash.flash_attention, causal=s.causal),
    }
    if device_kind == "gpu":
        peers["cudnn"] = functools.partial(
            jax.nn.dot_product_attention, is_causal=s.causal, implementation="cudnn"
        )
        try:
            from jax.experimental.pallas.ops.gpu import attention as pallas_attention
        except ImportError:
            pallas_attention = None
        if pallas_attention is not None:

            def pallas_mha(q, k, v):
                g = s.heads_q // s.heads_kv
                if g > 1:  # the Pallas kernel has no GQA: repeat K/V heads (inside the timing)
                    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
                return pallas_attention.mha(
                    q, k, v, segment_ids=None, sm_scale=s.head_dim**-0.5, causal=s.causal
                )

            peers["pallas_triton"] = pallas_mha
    peers["xla_dpa"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=s.causal, implementation="xla"
    )
    peers["jnp_reference"] = functools.partial(
        jax_flash.flash_attention, causal=s.causal, implementation="xla"
    )
    return peers


def _grid(name: str, device_kind: str, dtypes) -> list[PrefillShape]:
    if device_kind != "gpu":
        sizes = [(1, 512), (1, 2048)] if name == "quick" else [(1, 512), (1, 2048), (1, 4096)]
        return [
            PrefillShape(b, s, 8, h_kv, 128, causal, dt)
            for dt in dtypes
            for (b, s) in sizes
            for h_kv in (8, 2)
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


def _prefill_n(kind, name, s: PrefillShape, roof) -> int:
    """Calls per loop run, from the expected rate of this kind of implementation."""
    slow = name in _MATERIALISING
    if kind == "gpu":
        rate = roof.get("bf16_matmul_tflops", 700.0) * 1e12 * (0.06 if slow else 0.5)
        return _pick_n(s.flops / rate, 0.04, 2, 200)
    rate = 1e11 * (0.3 if slow else 1.0)
    return _pick_n(s.flops / rate, 0.01, 1, 3)


def run_prefill(
    grid="quick",
    dtypes=("bfloat16",),
    out_dir=None,
    reference_limit=4096,
    shapes=None,
    skip=(),
):
    device, kind, info, roof = _start(grid)
    mem = _mem_limit(device)
    shapes = _grid(grid, kind, dtypes) if shapes is None else list(shapes)
    out_path = _out_path("prefill", info, out_dir) if out_dir else None
    rows = []
    t_start = time.perf_counter()
    for i, s in enumerate(shapes):
        _progress(i, len(shapes), t_start, s.label())
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
                print(f"    (no float32 reference: {_error(e)})", flush=True)
        row = {"shape": dataclasses.asdict(s), "results": {}}
        row["harness_us"] = 1e6 * _harness_time((q, k, v), (0, 1, 2), 500 if kind == "gpu" else 5)
        for name, fn in _peers(kind, s).items():
            if _skipped(name, skip):
                continue
            if name in _MATERIALISING and not fits:
                res = {
                    "error": f"skipped: the S x S scores need ~{s.scores_bytes / 2**30:.0f} GiB "
                    f"(over half of the {mem / 2**30:.0f} GiB this process may allocate)"
                }
            else:
                try:
                    n = _prefill_n(kind, name, s, roof)
                    t, out = _loop_time(fn, (q, k, v), n=n, chain=(0, 1, 2))
                    res = {"ms": t * 1e3, "tflops": s.flops / t / 1e12, "n": n}
                    if ref is not None:
                        res["rel_err"] = _rel_err(out, ref)
                    del out
                except Exception as e:  # a peer that cannot run this shape (OOM, unsupported)
                    res = {"error": _error(e)}
            row["results"][name] = res
            msg = (
                f"    {name:14s} {res['ms']:9.3f} ms {res['tflops']:9.4f} TFLOP/s"
                + (f"  err {res['rel_err']:.2e}" if "rel_err" in res else "")
                if "ms" in res
                else f"    {name:14s} {res['error']}"
            )
            print(msg, flush=True)
        print(f"    (loop harness {row['harness_us']:.1f} us/iteration)", flush=True)
        rows.append(row)
        if out_path:
            _save_partial(out_path, "prefill", info, roof, rows)
        del q, k, v, ref
    elapsed = time.perf_counter() - t_start
    _print_table(rows, kind)
    print(f"({len(rows)} rows in {elapsed:.0f} s)")
    info["elapsed_s"] = elapsed
    result = {"benchmark": "prefill", "info": info, "rooflines": roof, "rows": rows}
    if out_dir:
        _save(result, out_dir, out_path)
    return result


def _num(x: float, width: int) -> str:
    return f"{x:{width}.0f}" if abs(x) >= 100 else f"{x:{width}.2f}"


def _ratio(a: dict, b: dict, key: str) -> float:
    return a[key] / b[key] if key in a and key in b else float("nan")


def _print_table(rows, kind):
    bases = ("cudnn", "pallas_triton") if kind == "gpu" else ("jnp_reference",)
    names = []
    for r in rows:
        for n in r["results"]:
            if n not in names:
                names.append(n)
    unit, scale = ("TFLOP/s", 1.0) if kind == "gpu" else ("GFLOP/s", 1e3)
    w = max(len(n) for n in names) + 2
    wr = max(len(b) for b in bases) + 5
    print()
    print(
        f"{'shape':38s}"
        + "".join(f"{n:>{w}s}" for n in names)
        + "".join(f"{'jf/' + b:>{wr}s}" for b in bases)
    )
    for r in rows:
        s = PrefillShape(**r["shape"])
        cells = []
        for n in names:
            res = r["results"].get(n, {})
            cells.append(f"{res['tflops'] * scale:{w}.1f}" if "tflops" in res else f"{'-':>{w}s}")
        jf = r["results"].get("jax_flash", {})
        ratios = [_ratio(jf, r["results"].get(b, {}), "tflops") for b in bases]
        print(f"{s.label():38s}" + "".join(cells) + "".join(f"{x:{wr}.2f}" for x in ratios))
    print(f"({unit}; causal counts half the FLOPs; '-': failed or skipped, see the log/JSON)")


# ---------------------------------------------------------------------------------------------
# saving and plots


def _out_path(name, info, out_dir):
    """Path (without extension) of a run's JSON and PNG: benchmark, device and start time."""
    dev = info["device"].replace(" ", "_")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return os.path.join(out_dir, f"{name}_{dev}_{stamp}")


def _save_partial(path, name, info, roof, rows):
    """The rows measured so far, rewritten after each row (a run cut short keeps them)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = {"benchmark": name, "info": info, "rooflines": roof, "rows": rows, "partial": True}
    with open(path + ".json", "w") as f:
        json.dump(partial, f, indent=1)


def _save(result, out_dir, path=None):
    """JSON of the whole result, and a PNG plot (if matplotlib is installed)."""
    name = result["benchmark"]
    os.makedirs(out_dir, exist_ok=True)
    path = path or _out_path(name, result["info"], out_dir)
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {path}.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig = {"prefill": _plot_prefill, "decode": _plot_decode}[name](plt, result)
    fig.savefig(path + ".png", dpi=110)
    plt.close(fig)
    print(f"saved {path}.png")


def _plot_prefill(plt, result):
    groups = {}
    for r in result["rows"]:
        s = r["shape"]
        key = (s["dtype"], s["heads_q"], s["heads_kv"], s["head_dim"], s["causal"])
        groups.setdefault(key, []).append(r)
    n = max(1, len(groups))
    cols = min(n, 4)
    fig, axes = plt.subplots(
        math.ceil(n / cols), cols, figsize=(4.5 * cols, 3.5 * math.ceil(n / cols)), squeeze=False
    )
    every = sorted({m for r in result["rows"] for m in r["results"]})
    color = {m: f"C{i}" for i, m in enumerate(every)}  # one colour per implementation
    for ax, (key, rs) in zip(axes.flat, groups.items(), strict=False):
        impls = {m for r in rs for m in r["results"]}
        for impl in sorted(impls):
            done = [r for r in rs if "tflops" in r["results"].get(impl, {})]
            xs = [r["shape"]["seqlen"] for r in done]
            ys = [r["results"][impl]["tflops"] for r in done]
            if xs:
                ax.plot(xs, ys, marker="o", label=impl, color=color[impl])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} H{key[1]}/{key[2]} D{key[3]} {'causal' if key[4] else 'full'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    fig.suptitle(f"prefill attention, {result['info']['device']}")
    fig.tight_layout()
    return fig


def _plot_decode(plt, result):
    rows = result["rows"]
    impls = [
        m
        for m in ("jax_flash", "pallas_best", "cudnn_contiguous", "jnp_gather")
        if any("gbps" in r["results"].get(m, {}) for r in rows)
    ]
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.13 * len(rows) * max(1, len(impls))))
    height = 0.8 / max(1, len(impls))
    ys = np.arange(len(rows))
    for j, impl in enumerate(impls):
        vals = [r["results"].get(impl, {}).get("gbps", 0.0) for r in rows]
        ax.barh(ys + (j - (len(impls) - 1) / 2) * height, vals, height, label=impl)
    roof = result.get("rooflines", {}).get("hbm_read_gbps")
    if roof:
        ax.axvline(roof, color="k", linestyle="--", linewidth=1, label="HBM read")
    ax.set_yticks(ys, [DecodeShape(**r["shape"]).label() for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("effective KV bandwidth, GB/s (bytes of K, V and scales read / time)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"paged decode attention, {result['info']['device']}")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# decode


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    ctx: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    dtype: str  # of q
    cache_dtype: str  # q's dtype, or int8 / float8_e4m3fn (scaled)
    seqlen_q: int = 1
    scales: str = "token"  # quantized caches: "token" (per token and head) or "head" (per head)

    @property
    def quantized(self) -> bool:
        return self.cache_dtype in _QUANTIZED

    @property
    def kv_bytes(self) -> float:
        """Bytes of K and V read: the cache elements, plus the float32 scales of a quantized
        cache with per-token scales (one per token and head, for K and for V)."""
        per_token_head = self.head_dim * jnp.dtype(self.cache_dtype).itemsize
        if self.quantized and self.scales == "token":
            per_token_head += 4
        return 2.0 * self.batch * self.ctx * self.heads_kv * per_token_head

    @property
    def gather_bytes(self) -> float:
        """Memory of the float32 dense copy of K and V the jnp gather reference makes."""
        return 2.0 * self.batch * self.ctx * self.heads_kv * self.head_dim * 4

    def label(self) -> str:
        dt = _short(self.dtype)
        if self.cache_dtype != self.dtype:
            dt += "/" + _short(self.cache_dtype)
        if self.quantized and self.scales == "head":
            dt += "/head"
        return (
            f"{dt} B{self.batch} ctx{_kilo(self.ctx)} H{self.heads_q}/{self.heads_kv} "
            f"D{self.head_dim} p{self.page_size} Sq{self.seqlen_q}"
        )


# The decode-speed grid: batch x context from one long sequence to many short ones.
_DECODE_BC = ((1, 131072), (1, 32768), (8, 8192), (32, 4096), (64, 8192), (128, 2048), (256, 1024))
_DECODE_AROUND = ((64, 8192), (1, 32768), (256, 1024))  # where each other axis is varied


def _decode_variations(base: DecodeShape) -> list[DecodeShape]:
    """One axis at a time away from `base`: head configs, head dims, page size, Sq, the other
    16-bit dtype, int8 and fp8 pages."""
    other = "float16" if base.dtype != "float16" else "bfloat16"
    r = dataclasses.replace
    return [
        *(r(base, heads_q=hq, heads_kv=hkv) for hq, hkv in ((32, 32), (64, 8), (28, 4))),
        *(r(base, head_dim=d) for d in (64, 256)),
        r(base, page_size=64),
        r(base, seqlen_q=4),
        r(base, dtype=other, cache_dtype=other),
        r(base, cache_dtype="int8"),
        r(base, cache_dtype="float8_e4m3fn"),
        r(base, cache_dtype="float8_e4m3fn", scales="head"),
    ]


def _decode_grid(name, device_kind, dtypes) -> list[DecodeShape]:
    def base(dt, b, c, **kw):
        cfg = dict(heads_q=32, heads_kv=8, head_dim=128, page_size=16, seqlen_q=1)
        cfg.update(kw)
        return DecodeShape(b, c, dtype=dt, cache_dtype=dt, **cfg)

    dt0 = dtypes[0]
    if device_kind != "gpu":
        bc = ((1, 4096), (8, 1024))
        shapes = [base(dt, b, c, heads_q=8, heads_kv=2) for dt in dtypes for b, c in bc]
        small = base(dt0, 8, 1024, heads_q=8, heads_kv=2)
        r = dataclasses.replace
        shapes += [r(small, cache_dtype="int8"), r(small, cache_dtype="float8_e4m3fn")]
        shapes += [r(small, cache_dtype="float8_e4m3fn", scales="head")]
        if name == "full":
            shapes += [r(small, seqlen_q=4), r(small, page_size=64), r(small, head_dim=64)]
        return list(dict.fromkeys(shapes))
    if name == "quick":
        bc = ((1, 32768), (8, 8192), (64, 8192), (128, 2048), (256, 1024))
        shapes = [base(dt, b, c) for dt in dtypes for b, c in bc]
        shapes += [
            dataclasses.replace(base(dt0, 64, 8192), cache_dtype=cd, scales=sc)
            for sc in ("token", "head")
            for cd in _QUANTIZED
        ]
        return list(dict.fromkeys(shapes))
    shapes = [base(dt, b, c) for dt in dtypes for b, c in _DECODE_BC]
    for b, c in _DECODE_AROUND:
        shapes += _decode_variations(base(dt0, b, c))
    return list(dict.fromkeys(shapes))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_pages(key, shape, dtype, cache_dtype, scales="token"):
    """Random normal pages; a quantized cache also gets its scales: per token and head
    ([num_pages, page_size, Hkv], amax / qmax as append_kv writes them) or per head ([Hkv], amax
    over the whole cache / qmax)."""
    if cache_dtype not in _QUANTIZED:
        return jax.random.normal(key, shape, dtype), None
    x = jax.random.normal(key, shape, jnp.float32)
    if scales == "head":
        scale = reference.per_token_scale(x, cache_dtype).max(axis=(0, 1))
        return reference.quantize(x, scale[:, None], cache_dtype), scale
    scale = reference.per_token_scale(x, cache_dtype)
    return reference.quantize(x, scale[..., None], cache_dtype), scale


def _make_paged(s: DecodeShape, key):
    """(q, k_pages, v_pages, block_tables, kv_lens, k_scale, v_scale); scales None unless the
    cache is quantized. Each sequence's pages are a random permutation of the pool."""
    pages_per_seq = -(-s.ctx // s.page_size)
    num_pages = s.batch * pages_per_seq
    kq, kk, kv, kp = jax.random.split(key, 4)
    q_shape = (
        (s.batch, s.heads_q, s.head_dim)
        if s.seqlen_q == 1
        else (s.batch, s.seqlen_q, s.heads_q, s.head_dim)
    )
    q = jax.random.normal(kq, q_shape, jnp.dtype(s.dtype))
    shape = (num_pages, s.page_size, s.heads_kv, s.head_dim)
    k_pages, k_scale = _random_pages(kk, shape, s.dtype, s.cache_dtype, s.scales)
    v_pages, v_scale = _random_pages(kv, shape, s.dtype, s.cache_dtype, s.scales)
    perm = jax.random.permutation(kp, num_pages).astype(jnp.int32)
    block_tables = perm.reshape(s.batch, pages_per_seq)
    kv_lens = jnp.full((s.batch,), s.ctx, jnp.int32)
    return q, k_pages, v_pages, block_tables, kv_lens, k_scale, v_scale


# Every decode peer is fn(q, k, v, block_tables, kv_lens, k_scale, v_scale) -> o, on arguments in
# its own layout; the timing loop chains q (position 0) and block_tables (position 3), so a peer
# that gathers the pages cannot have the gather hoisted out of the loop.
_DECODE_CHAIN = (0, 3)


def _decode_peers(kind, s: DecodeShape, mem: float):
    """[(make_args, {name: fn, or a string saying why it does not run})]: make_args(data)
    builds the group's arguments from _make_paged's (a peer's own copy of the cache, dropped
    after the group)."""

    def jf(q, kp, vp, bt, kl, ks, vs):
        return jax_flash.paged_attention(q, kp, vp, bt, kl, k_scale=ks, v_scale=vs)

    def gather(q, kp, vp, bt, kl, ks, vs):
        return jax_flash.paged_attention(
            q, kp, vp, bt, kl, k_scale=ks, v_scale=vs, implementation="xla"
        )

    same = lambda data: data  # noqa: E731
    groups = [(same, {"jax_flash": jf})]
    if kind == "gpu":
        groups.append(_pallas_group(s))
        groups.append(_cudnn_group(s))
    if 1.5 * s.gather_bytes > 0.5 * mem:
        gather = (
            f"skipped: the float32 dense copy of the cache needs ~{s.gather_bytes / 2**30:.0f} "
            f"GiB (over half of the {mem / 2**30:.0f} GiB this process may allocate)"
        )
    groups.append((same, {"jnp_gather": gather}))
    return groups


def _pallas_group(s: DecodeShape):
    """JAX Pallas (Triton) paged_attention at k_splits 1/4/16 on a head-major copy of the cache
    ([Hkv, pages, page_size, D], scales [Hkv, pages, page_size]: per-head scales are repeated
    per token, the only scale layout it takes) and q scaled by 1/sqrt(D)."""
    names = [f"pallas_k{k}" for k in (1, 4, 16)]
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
    except ImportError as e:
        return (None, dict.fromkeys(names, f"unavailable: {_error(e)}"))
    if s.seqlen_q != 1:
        why = "unsupported: Pallas paged_attention takes one query per sequence (q [B, Hq, D])"
        return (None, dict.fromkeys(names, why))

    @jax.jit
    def head_major(data):
        q, kp, vp, bt, kl, ks, vs = data
        kh, vh = (jnp.transpose(x, (2, 0, 1, 3)) for x in (kp, vp))
        if ks is not None and ks.ndim == 1:  # per head
            ks, vs = (jnp.broadcast_to(x[:, None, None], kh.shape[:3]) for x in (ks, vs))
        elif ks is not None:
            ks, vs = (jnp.transpose(x, (2, 0, 1)) for x in (ks, vs))
        # The Pallas kernel applies no softmax scale: fold 1/sqrt(D) into q (outside the timing,
        # as a model would fold it into the query projection).
        q = (q.astype(jnp.float32) * s.head_dim**-0.5).astype(q.dtype)
        return q, kh, vh, bt, kl, ks, vs

    pages_per_seq = -(-s.ctx // s.page_size)
    peers = {}
    for splits, name in zip((1, 4, 16), names, strict=True):
        if pages_per_seq % splits:
            peers[name] = f"unsupported: {pages_per_seq} pages per sequence % k_splits {splits}"
            continue
        # about 128 tokens per compute block, dividing the pages of one split
        ppcb = math.gcd(max(1, 128 // s.page_size), pages_per_seq // splits)

        def fn(q, kh, vh, bt, kl, ks, vs, splits=splits, ppcb=ppcb):
            return pallas_paged.paged_attention(
                q, kh, vh, bt, kl, ks, vs, k_splits=splits, pages_per_compute_block=ppcb
            )

        peers[name] = fn
    return (head_major, peers)


def _cudnn_group(s: DecodeShape):
    """cuDNN (jax.nn.dot_product_attention) on a contiguous [B, ctx, Hkv, D] copy of the cache:
    the bound without paging."""
    name = "cudnn_contiguous"
    if s.quantized:
        return (None, {name: "unsupported: cuDNN attention here takes a bf16/fp16 cache only"})

    @jax.jit
    def contiguous(data):
        q, kp, vp, bt, kl, ks, vs = data
        kd, vd = (reference.gather_pages(x, bt).astype(x.dtype) for x in (kp, vp))
        return q, kd, vd, bt, kl, None, None

    def cudnn(q, kd, vd, bt, kl, ks, vs):
        q4 = q[:, None] if q.ndim == 3 else q
        # Sq > 1: no mask (cuDNN's causal mask is top-left aligned, the cache's bottom-right)
        o = jax.nn.dot_product_attention(q4, kd, vd, implementation="cudnn")
        return o[:, 0] if q.ndim == 3 else o

    return (contiguous, {name: cudnn})


def _decode_n(kind, name, s: DecodeShape, roof) -> int:
    """Calls per loop run, from the expected bandwidth of this kind of implementation."""
    slow = name == "jnp_gather"
    if kind == "gpu":
        bw = roof.get("hbm_read_gbps", 3000.0) * 1e9 * (0.3 if slow else 0.7)
        return _pick_n(s.kv_bytes / bw + 5e-6, 0.1, 5, 5000)
    bw = 1e10 * (0.05 if slow else 1.0)
    return _pick_n(s.kv_bytes / bw, 0.01, 1, 5)


def _time_decode_peer(kind, name, fn, args, s: DecodeShape, roof, ref) -> dict:
    n = _decode_n(kind, name, s, roof)
    t, out = _loop_time(fn, args, n=n, chain=_DECODE_CHAIN)
    res = {
        "us": t * 1e6,
        "gbps": s.kv_bytes / t / 1e9,
        "tokens_per_s": s.batch * s.seqlen_q / t,
        "n": n,
    }
    if roof:
        res["pct_roofline"] = 100 * res["gbps"] / roof["hbm_read_gbps"]
    if name == "cudnn_contiguous" and s.seqlen_q > 1:
        res["note"] = "no causal mask (timing only)"
    elif ref is not None:
        res["rel_err"] = _rel_err(out, ref)
    return res


def run_decode(grid="quick", dtypes=("bfloat16",), out_dir=None, shapes=None, skip=()):
    device, kind, info, roof = _start(grid)
    mem = _mem_limit(device)
    shapes = _decode_grid(grid, kind, dtypes) if shapes is None else list(shapes)
    out_path = _out_path("decode", info, out_dir) if out_dir else None
    rows = []
    t_start = time.perf_counter()
    for i, s in enumerate(shapes):
        _progress(i, len(shapes), t_start, s.label())
        data = _make_paged(s, jax.random.key(2000 + i))
        ref = None
        if 1.5 * s.gather_bytes < 0.5 * mem:
            q, kp, vp, bt, kl, ks, vs = data
            try:
                ref = jax.jit(reference.paged_attention)(
                    q.astype(jnp.float32), kp, vp, bt, kl, k_scale=ks, v_scale=vs
                )
                ref = np.asarray(ref)
            except Exception as e:  # no reference: results without rel_err
                print(f"    (no float32 reference: {_error(e)})", flush=True)
        row = {"shape": dataclasses.asdict(s), "results": {}}
        row["harness_us"] = 1e6 * _harness_time(data, _DECODE_CHAIN, 500 if kind == "gpu" else 5)
        for make_args, group in _decode_peers(kind, s, mem):
            args = None
            for name, fn in group.items():
                if _skipped(name, skip):
                    continue
                if isinstance(fn, str):
                    res = {"error": fn}
                else:
                    try:
                        if args is None:
                            args = make_args(data)
                        res = _time_decode_peer(kind, name, fn, args, s, roof, ref)
                    except Exception as e:  # a peer that cannot run this shape
                        res = {"error": _error(e)}
                row["results"][name] = res
                print(
                    f"    {name:18s} {res['us']:10.1f} us {res['gbps']:8.1f} GB/s"
                    + (f" {res['pct_roofline']:5.1f}%" if "pct_roofline" in res else "")
                    + f" {res['tokens_per_s']:11.0f} tok/s"
                    + (f"  err {res['rel_err']:.2e}" if "rel_err" in res else "")
                    + (f"  ({res['note']})" if "note" in res else "")
                    if "us" in res
                    else f"    {name:18s} {res['error']}",
                    flush=True,
                )
            del args
        pallas = {n: r for n, r in row["results"].items() if n.startswith("pallas_k")}
        if pallas:
            ok = {n: r for n, r in pallas.items() if "gbps" in r}
            if ok:
                best = max(ok, key=lambda n: ok[n]["gbps"])
                row["results"]["pallas_best"] = {**ok[best], "from": best}
            else:
                row["results"]["pallas_best"] = {"error": next(iter(pallas.values()))["error"]}
        print(f"    (loop harness {row['harness_us']:.1f} us/iteration)", flush=True)
        rows.append(row)
        if out_path:
            _save_partial(out_path, "decode", info, roof, rows)
        del data, ref
    elapsed = time.perf_counter() - t_start
    _print_decode_table(rows, roof)
    summary = _decode_summary(rows, dtypes[0])
    print(f"({len(rows)} rows in {elapsed:.0f} s)")
    info["elapsed_s"] = elapsed
    result = {
        "benchmark": "decode",
        "info": info,
        "rooflines": roof,
        "summary": summary,
        "rows": rows,
    }
    if out_dir:
        _save(result, out_dir, out_path)
    return result


def _print_decode_table(rows, roof):
    peers = {"pallas_best": "pallas", "cudnn_contiguous": "cudnn", "jnp_gather": "gather"}
    print()
    print(
        f"{'shape':40s}{'jf us':>10s}{'jf GB/s':>9s}{'%roof':>6s}{'jf tok/s':>10s}"
        + "".join(f"{v + ' GB/s':>13s}" for v in peers.values())
        + f"{'jf/pallas':>10s}{'jf/cudnn':>9s}"
    )
    for r in rows:
        res = r["results"]
        jf = res.get("jax_flash", {})
        if "us" in jf:
            cells = f"{jf['us']:10.1f}" + _num(jf["gbps"], 9)
            cells += f"{jf['pct_roofline']:6.1f}" if "pct_roofline" in jf else f"{'-':>6s}"
            cells += f"{jf['tokens_per_s']:10.0f}"
        else:
            cells = f"{'-':>10s}{'-':>9s}{'-':>6s}{'-':>10s}"
        for n in peers:
            cells += _num(res[n]["gbps"], 13) if "gbps" in res.get(n, {}) else f"{'-':>13s}"
        cells += f"{_ratio(jf, res.get('pallas_best', {}), 'gbps'):10.2f}"
        cells += f"{_ratio(jf, res.get('cudnn_contiguous', {}), 'gbps'):9.2f}"
        print(f"{DecodeShape(**r['shape']).label():40s}{cells}")
    print(
        "(GB/s: bytes of K, V and scales read / time; %roof: of the measured HBM read "
        f"bandwidth{' ' + format(roof['hbm_read_gbps'], '.0f') + ' GB/s' if roof else ''}; "
        "tok/s: B * Sq / time; '-': failed or skipped, see the log/JSON)"
    )


def _decode_summary(rows, dtype) -> dict:
    """tokens/s of an int8 / fp8 cache (per-token scales; "_head": per-head scales) over the
    `dtype` cache at B=64 ctx=8k (GQA 32/8, D128, page 16, Sq 1), for jax_flash and the best
    Pallas."""
    base = DecodeShape(64, 8192, 32, 8, 128, 16, dtype, dtype)
    by_shape = {DecodeShape(**r["shape"]): r["results"] for r in rows}
    summary = {}
    if base not in by_shape:
        return summary
    for sc in ("token", "head"):
        for cd in _QUANTIZED:
            quant = by_shape.get(dataclasses.replace(base, cache_dtype=cd, scales=sc))
            if quant is None:
                continue
            name = _short(cd) + ("_head" if sc == "head" else "")
            keys = {}
            for impl in ("jax_flash", "pallas_best"):
                ratio = _ratio(quant.get(impl, {}), by_shape[base].get(impl, {}), "tokens_per_s")
                keys[impl] = f"{impl}_{name}_over_{_short(dtype)}_tokens_per_s_B64_ctx8k"
                summary[keys[impl]] = ratio
            print(
                f"{_short(cd)} cache ({sc} scales) tokens/s / {_short(dtype)} cache tokens/s at "
                f"B64 ctx8k: jax_flash {summary[keys['jax_flash']]:.2f}, "
                f"pallas_best {summary[keys['pallas_best']]:.2f}"
            )
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m jax_flash.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("which", choices=["prefill", "decode"])
    parser.add_argument("--grid", choices=["quick", "full"], default="quick")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["bfloat16"],
        help="prefill: the dtypes of the grid; decode: the query/cache dtypes of the base grid "
        "(the first also the centre of the one-axis variations, int8/fp8 caches included)",
    )
    parser.add_argument("--out", default=None, help="directory for JSON and PNG")
    parser.add_argument(
        "--skip",
        nargs="+",
        default=[],
        metavar="PEER",
        help="peers not to run (a name or a prefix: xla_dpa, pallas, cudnn, jnp_gather, ...)",
    )
    args = parser.parse_args(argv)
    run = run_prefill if args.which == "prefill" else run_decode
    run(args.grid, tuple(args.dtype), args.out, skip=tuple(args.skip))


if __name__ == "__main__":
    main()
