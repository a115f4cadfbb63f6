"""Benchmarks of jax_flash against its peers, measured in one process on one device.

    python -m jax_flash.bench prefill [--grid quick|full] [--out DIR] [--dtype bfloat16 ...]

Each row times jax_flash and the peers available on the device on the same fresh random inputs:
on GPU `jax.nn.dot_product_attention` with implementation "cudnn" and "xla", JAX Pallas
(Triton) `mha`, and the jnp reference; on CPU the jnp reference and
`jax.nn.dot_product_attention(implementation="xla")`. Times are medians of jitted calls after
warm-up, synchronised with `block_until_ready`. Every result also gets its relative error against
the float32 reference on the same inputs (where the reference fits in memory). The table is
printed; JSON (with device, versions, rooflines) and a PNG plot go to --out.
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

    def label(self) -> str:
        c = "causal" if self.causal else "full"
        return (
            f"{self.dtype} B{self.batch} S{self.seqlen} H{self.heads_q}/{self.heads_kv} "
            f"D{self.head_dim} {c}"
        )


def _median_time(fn, args, *, warmup=3, iters=10, min_time=0.2) -> float:
    """Median seconds per call of a jitted fn (synchronised), after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start < min_time and len(times) < 200):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


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

            def pallas_mha(q, k, v):
                g = s.heads_q // s.heads_kv
                if g > 1:  # the Pallas kernel has no GQA: repeat K/V heads
                    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
                return pallas_attention.mha(q, k, v, segment_ids=None, causal=s.causal)

            peers["pallas_triton"] = pallas_mha
        except ImportError:
            pass
    peers["xla_dpa"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=s.causal, implementation="xla"
    )
    peers["jnp_reference"] = functools.partial(
        jax_flash.flash_attention, causal=s.causal, implementation="xla"
    )
    return peers


def _rooflines(device_kind: str) -> dict:
    """Measured bf16 matmul rate and device-memory copy bandwidth of this device."""
    if device_kind != "gpu":
        return {}
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    t = _median_time(jax.jit(jnp.matmul), (a, b))
    x = jax.random.normal(jax.random.key(3), (1 << 30,), jnp.bfloat16)  # 2 GiB
    tc = _median_time(jax.jit(lambda x: x * 2), (x,))
    return {
        "bf16_matmul_tflops": 2 * n**3 / t / 1e12,
        "hbm_copy_read_plus_write_gbps": 2 * x.size * 2 / tc / 1e9,
    }


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
    shapes = []
    for dt in dtypes:
        for d in (64, 128, 256):
            for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
                batch = max(1, 16384 // seqlen)
                for hq, hkv in ((32, 8), (32, 32)):
                    for causal in (True, False):
                        shapes.append(PrefillShape(batch, seqlen, hq, hkv, d, causal, dt))
    return shapes


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


def run_prefill(grid="quick", dtypes=("bfloat16",), out_dir=None, reference_limit=4096):
    device = jax.devices()[0]
    kind = "gpu" if device.platform == "gpu" else "cpu"
    info = _device_info(device)
    print(f"# device: {info['device']} ({kind}), jax {info['jax']}", flush=True)
    roof = _rooflines(kind)
    if roof:
        print(
            f"# rooflines: bf16 matmul {roof['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"copy {roof['hbm_copy_read_plus_write_gbps']:.0f} GB/s (read+write)",
            flush=True,
        )
    shapes = _grid(grid, kind, dtypes)
    rows = []
    for i, s in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {s.label()}", flush=True)
        dtype = jnp.dtype(s.dtype)
        keys = jax.random.split(jax.random.key(1000 + i), 3)
        q = jax.random.normal(keys[0], (s.batch, s.seqlen, s.heads_q, s.head_dim), dtype)
        k = jax.random.normal(keys[1], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
        v = jax.random.normal(keys[2], (s.batch, s.seqlen, s.heads_kv, s.head_dim), dtype)
        ref = None
        if s.seqlen <= reference_limit and s.batch * s.heads_q * s.seqlen**2 * 4 < 8 << 30:
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            ref = jax.jit(functools.partial(reference.attention, causal=s.causal))(*f32)
            ref = np.asarray(ref)
        row = {"shape": dataclasses.asdict(s), "results": {}}
        for name, fn in _peers(kind, s).items():
            if name in ("xla_dpa", "jnp_reference") and ref is None:
                row["results"][name] = {"error": "skipped: scores do not fit in memory"}
                continue
            try:
                f = jax.jit(fn)
                t = _median_time(f, (q, k, v))
                out = f(q, k, v)
                res = {"ms": t * 1e3, "tflops": s.flops / t / 1e12}
                if ref is not None:
                    res["rel_err"] = _rel_err(out, ref)
                del out
            except Exception as e:  # a peer that cannot run this shape (OOM, unsupported)
                res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            row["results"][name] = res
            msg = (
                f"    {name:14s} {res['ms']:9.3f} ms {res['tflops']:9.4f} TFLOP/s"
                + (f"  err {res['rel_err']:.2e}" if "rel_err" in res else "")
                if "ms" in res
                else f"    {name:14s} {res['error']}"
            )
            print(msg, flush=True)
        rows.append(row)
    _print_table(rows, kind)
    result = {"benchmark": "prefill", "info": info, "rooflines": roof, "rows": rows}
    if out_dir:
        _save(result, out_dir, "prefill")
    return result


def _print_table(rows, kind):
    base = "cudnn" if kind == "gpu" else "jnp_reference"
    names = []
    for r in rows:
        for n in r["results"]:
            if n not in names:
                names.append(n)
    unit, scale = ("TFLOP/s", 1.0) if kind == "gpu" else ("GFLOP/s", 1e3)
    print()
    print(f"{'shape':48s}" + "".join(f"{n:>15s}" for n in names) + f"  jax_flash/{base}")
    for r in rows:
        s = PrefillShape(**r["shape"])
        cells = []
        for n in names:
            res = r["results"].get(n, {})
            cells.append(f"{res['tflops'] * scale:15.1f}" if "tflops" in res else f"{'-':>15s}")
        jf, b = r["results"].get("jax_flash", {}), r["results"].get(base, {})
        ratio = jf["tflops"] / b["tflops"] if "tflops" in jf and "tflops" in b else float("nan")
        print(f"{s.label():48s}" + "".join(cells) + f"{ratio:12.2f}")
    print(f"({unit}; causal counts half the FLOPs)")


def _save(result, out_dir, name):
    os.makedirs(out_dir, exist_ok=True)
    dev = result["info"]["device"].replace(" ", "_")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    path = os.path.join(out_dir, f"{name}_{dev}_{stamp}")
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
    groups = {}
    for r in result["rows"]:
        s = r["shape"]
        key = (s["dtype"], s["heads_q"], s["heads_kv"], s["head_dim"], s["causal"])
        groups.setdefault(key, []).append(r)
    n = len(groups)
    cols = min(n, 4)
    fig, axes = plt.subplots(
        math.ceil(n / cols), cols, figsize=(4.5 * cols, 3.5 * math.ceil(n / cols)), squeeze=False
    )
    for ax, (key, rs) in zip(axes.flat, groups.items(), strict=False):
        impls = {m for r in rs for m in r["results"]}
        for impl in sorted(impls):
            done = [r for r in rs if "tflops" in r["results"].get(impl, {})]
            xs = [r["shape"]["seqlen"] for r in done]
            ys = [r["results"][impl]["tflops"] for r in done]
            if xs:
                ax.plot(xs, ys, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} H{key[1]}/{key[2]} D{key[3]} {'causal' if key[4] else 'full'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"prefill attention, {result['info']['device']}")
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=110)
    print(f"saved {path}.png")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_flash.bench", description=__doc__)
    parser.add_argument("which", choices=["prefill"])
    parser.add_argument("--grid", choices=["quick", "full"], default="quick")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--out", default=None, help="directory for JSON and PNG")
    args = parser.parse_args(argv)
    if args.which == "prefill":
        run_prefill(args.grid, tuple(args.dtype), args.out)


if __name__ == "__main__":
    main()
