"""Benchmarks of jax_flash against its peers, measured in one process on one device.

    python -m jax_flash.bench prefill [--grid quick|full] [--out DIR] [--dtype bfloat16 ...]
    python -m jax_flash.bench decode  [--grid quick|full] [--out DIR] [--dtype bfloat16 ...]

Each row times jax_flash and the peers available on the device on the same fresh random inputs:
on GPU `jax.nn.dot_product_attention` with implementation "cudnn" and "xla", JAX Pallas
(Triton) `mha`, and the jnp reference; on CPU the jnp reference and
`jax.nn.dot_product_attention(implementation="xla")`. Times are medians of jitted calls after
warm-up, synchronised with `block_until_ready`. Every result also gets its relative error against
the float32 reference on the same inputs (where the reference fits in memory). The table is
printed; JSON (with device, versions, rooflines) and a PNG plot go to --out.

Decode rows time paged attention over a paged KV cache (random page permutation) beside JAX
Pallas `paged_attention` (best of k_splits 1/4/16, on the same cache in its head-major layout),
the jnp gather reference, and cuDNN on a contiguous copy of the cache (the non-paged bound); the
figure of merit is the effective KV bandwidth, bytes of K and V read / time. Decode calls are
short, so each is timed inside one jitted `lax.fori_loop` of many calls (dispatch excluded).
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
    cache_dtype: str
    seqlen_q: int = 1

    @property
    def kv_bytes(self) -> float:
        elem = jnp.dtype(self.cache_dtype).itemsize
        return 2.0 * self.batch * self.ctx * self.heads_kv * self.head_dim * elem

    def label(self) -> str:
        return (
            f"{self.cache_dtype} B{self.batch} ctx{self.ctx} H{self.heads_q}/{self.heads_kv} "
            f"D{self.head_dim} p{self.page_size} Sq{self.seqlen_q}"
        )


def _loop_time(fn, args, n=20) -> float:
    """Seconds per call of fn(q, *rest), run n times inside one jitted fori_loop (the next q
    depends on the last output, so no call is hoisted or skipped)."""

    def body(_, carry):
        q, rest = carry[0], carry[1:]
        o = fn(q, *rest)
        q = q + (o.reshape(-1)[0] * 0).astype(q.dtype)
        return (q, *rest)

    loop = jax.jit(lambda *a: jax.lax.fori_loop(0, n, body, a)[0])
    return _median_time(loop, args, warmup=2, iters=5, min_time=0.0) / n


def _decode_grid(name, device_kind, dtypes):
    if device_kind != "gpu":
        return [
            DecodeShape(b, c, 8, 2, 128, 16, dt, dt)
            for dt in dtypes
            for b, c in ((1, 4096), (8, 1024))
        ]
    shapes = [(1, 32768), (8, 8192), (64, 8192), (128, 2048), (256, 1024)]
    if name == "full":
        shapes = [
            (1, 131072),
            (1, 32768),
            (1, 8192),
            (8, 8192),
            (32, 4096),
            (64, 8192),
            (128, 2048),
            (256, 1024),
        ]
    return [DecodeShape(b, c, 32, 8, 128, 16, dt, dt) for dt in dtypes for b, c in shapes]


def _make_paged(s: DecodeShape, key):
    pages_per_seq = -(-s.ctx // s.page_size)
    num_pages = s.batch * pages_per_seq
    kq, kk, kv, kp = jax.random.split(key, 4)
    dtype = jnp.dtype(s.dtype)
    q_shape = (
        (s.batch, s.heads_q, s.head_dim)
        if s.seqlen_q == 1
        else (s.batch, s.seqlen_q, s.heads_q, s.head_dim)
    )
    q = jax.random.normal(kq, q_shape, dtype)
    shape = (num_pages, s.page_size, s.heads_kv, s.head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    perm = jax.random.permutation(kp, num_pages).astype(jnp.int32)
    block_tables = perm.reshape(s.batch, pages_per_seq)
    kv_lens = jnp.full((s.batch,), s.ctx, jnp.int32)
    return q, k_pages, v_pages, block_tables, kv_lens


def _decode_peers(kind, s: DecodeShape, k_pages, v_pages, block_tables):
    peers = {"jax_flash": jax_flash.paged_attention}
    if kind == "gpu" and s.seqlen_q == 1:
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
        except ImportError:
            pallas_paged = None
        if pallas_paged is not None:
            # Pallas takes the head-major layout [Hkv, pages, page_size, D]: give it its own copy.
            kh = jnp.transpose(k_pages, (2, 0, 1, 3))
            vh = jnp.transpose(v_pages, (2, 0, 1, 3))
            for splits in (1, 4, 16):
                if block_tables.shape[1] % splits:
                    continue

                def fn(q, kh, vh, bt, kl, splits=splits):
                    return pallas_paged.paged_attention(
                        q,
                        kh,
                        vh,
                        bt,
                        kl,
                        k_splits=splits,
                        pages_per_compute_block=max(1, min(8, bt.shape[1] // splits)),
                    )

                fn.cache = (kh, vh)  # passed as arguments, not captured as constants
                peers[f"pallas_k{splits}"] = fn
        dense = functools.partial(reference.gather_pages, block_tables=block_tables)

        def cudnn(q, kd, vd, bt, kl):  # a contiguous copy of the cache in place of the pages
            return jax.nn.dot_product_attention(q[:, None], kd, vd, implementation="cudnn")[:, 0]

        cudnn.cache = (dense(k_pages).astype(s.dtype), dense(v_pages).astype(s.dtype))
        peers["cudnn_contiguous"] = cudnn
    peers["jnp_gather"] = functools.partial(jax_flash.paged_attention, implementation="xla")
    return peers


def _read_bandwidth(kind) -> dict:
    if kind != "gpu":
        return {}
    x = jax.random.normal(jax.random.key(5), (1 << 31,), jnp.bfloat16)  # 4 GiB
    t = _median_time(jax.jit(jnp.sum), (x,))
    return {"hbm_read_gbps": x.size * 2 / t / 1e9}


def run_decode(grid="quick", dtypes=("bfloat16",), out_dir=None):
    device = jax.devices()[0]
    kind = "gpu" if device.platform == "gpu" else "cpu"
    info = _device_info(device)
    print(f"# device: {info['device']} ({kind}), jax {info['jax']}", flush=True)
    roof = _read_bandwidth(kind)
    if roof:
        print(f"# HBM read bandwidth (jnp.sum of 4 GiB): {roof['hbm_read_gbps']:.0f} GB/s")
    shapes = _decode_grid(grid, kind, dtypes)
    rows = []
    for i, s in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {s.label()}", flush=True)
        q, kp, vp, bt, kl = _make_paged(s, jax.random.key(2000 + i))
        ref = None
        if s.batch * s.ctx <= 1 << 20:
            ref = np.asarray(
                jax.jit(reference.paged_attention)(q.astype(jnp.float32), kp, vp, bt, kl)
            )
        row = {"shape": dataclasses.asdict(s), "results": {}}
        for name, fn in _decode_peers(kind, s, kp, vp, bt).items():
            try:
                kk, vv = getattr(fn, "cache", (kp, vp))
                t = _loop_time(fn, (q, kk, vv, bt, kl))
                res = {"us": t * 1e6, "gbps": s.kv_bytes / t / 1e9}
                if roof:
                    res["pct_roofline"] = 100 * res["gbps"] / roof["hbm_read_gbps"]
                if ref is not None:
                    res["rel_err"] = _rel_err(jax.jit(fn)(q, kk, vv, bt, kl), ref)
            except Exception as e:
                res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            row["results"][name] = res
            print(
                f"    {name:18s} {res['us']:10.1f} us {res['gbps']:8.1f} GB/s"
                + (f"  err {res['rel_err']:.2e}" if "rel_err" in res else "")
                if "us" in res
                else f"    {name:18s} {res['error']}",
                flush=True,
            )
        pallas = [
            r["gbps"] for n, r in row["results"].items() if n.startswith("pallas") and "gbps" in r
        ]
        if pallas:
            row["results"]["pallas_best"] = {"gbps": max(pallas)}
        rows.append(row)
    print()
    names = ["jax_flash", "pallas_best", "cudnn_contiguous", "jnp_gather"]
    print(f"{'shape':52s}" + "".join(f"{n:>18s}" for n in names) + "   jf/pallas")
    for r in rows:
        cells = "".join(
            f"{r['results'][n]['gbps']:18.1f}"
            if "gbps" in r["results"].get(n, {})
            else f"{'-':>18s}"
            for n in names
        )
        jf, pb = r["results"].get("jax_flash", {}), r["results"].get("pallas_best", {})
        ratio = jf["gbps"] / pb["gbps"] if "gbps" in jf and "gbps" in pb else float("nan")
        print(f"{DecodeShape(**r['shape']).label():52s}{cells}{ratio:12.2f}")
    print("(effective KV bandwidth, GB/s = bytes of K and V read / time)")
    result = {"benchmark": "decode", "info": info, "rooflines": roof, "rows": rows}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        dev = info["device"].replace(" ", "_")
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
        path = os.path.join(out_dir, f"decode_{dev}_{stamp}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"saved {path}")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_flash.bench", description=__doc__)
    parser.add_argument("which", choices=["prefill", "decode"])
    parser.add_argument("--grid", choices=["quick", "full"], default="quick")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--out", default=None, help="directory for JSON and PNG")
    args = parser.parse_args(argv)
    if args.which == "prefill":
        run_prefill(args.grid, tuple(args.dtype), args.out)
    else:
        run_decode(args.grid, tuple(args.dtype), args.out)


if __name__ == "__main__":
    main()
