"""What a run prints: progress, one line per peer, the table at the end and the decode summary.
Only what was measured is shown: a column whose peer ran on no row is left out, and a cell
whose peer failed or was skipped (or a ratio with one side missing) is a dash."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jax_flash.bench.shapes import QUANTIZED, DecodeShape, PrefillShape, short

DASH = "-"


def error_text(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:200]}"


def rel_err(out, ref) -> float:
    """Relative L2 error of out against the float32 reference (NaN if out is not finite)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def ratio(a: dict, b: dict, key: str) -> float | None:
    """a[key] / b[key], or None where either side was not measured."""
    return a[key] / b[key] if key in a and key in b else None


def _cell(x: float | None, width: int, fmt: str) -> str:
    return f"{DASH:>{width}s}" if x is None else f"{x:{width}{fmt}}"


def _num(x: float | None, width: int) -> str:
    """A rate: no decimals from 100 on."""
    if x is None:
        return f"{DASH:>{width}s}"
    return f"{x:{width}.0f}" if abs(x) >= 100 else f"{x:{width}.2f}"


def _measured(rows, name: str, key: str) -> bool:
    return any(key in r["results"].get(name, {}) for r in rows)


def progress(i: int, total: int, t_start: float, label: str):
    print(f"[{i + 1}/{total} {time.perf_counter() - t_start:4.0f}s] {label}", flush=True)


def prefill_line(name: str, res: dict):
    if "ms" in res:
        msg = f"    {name:14s} {res['ms']:9.3f} ms {res['tflops']:9.4f} TFLOP/s"
        msg += f"  err {res['rel_err']:.2e}" if "rel_err" in res else ""
    else:
        msg = f"    {name:14s} {res['error']}"
    print(msg, flush=True)


def decode_line(name: str, res: dict):
    if "us" in res:
        msg = (
            f"    {name:18s} {res['us']:10.1f} us {res['gbps']:8.1f} GB/s"
            + (f" {res['pct_roofline']:5.1f}%" if "pct_roofline" in res else "")
            + f" {res['tokens_per_s']:11.0f} tok/s"
            + (f"  err {res['rel_err']:.2e}" if "rel_err" in res else "")
            + (f"  ({res['note']})" if "note" in res else "")
        )
    else:
        msg = f"    {name:18s} {res['error']}"
    print(msg, flush=True)


def prefill_table(rows, kind: str):
    bases = ("cudnn", "pallas_triton") if kind == "gpu" else ("jnp_reference",)
    bases = [b for b in bases if _measured(rows, b, "tflops")]
    names = []
    for r in rows:
        for n in r["results"]:
            if n not in names:
                names.append(n)
    unit, scale = ("TFLOP/s", 1.0) if kind == "gpu" else ("GFLOP/s", 1e3)
    w = max(len(n) for n in names) + 2
    wr = max((len(b) for b in bases), default=0) + 5
    print()
    print(
        f"{'shape':38s}"
        + "".join(f"{n:>{w}s}" for n in names)
        + "".join(f"{'jf/' + b:>{wr}s}" for b in bases)
    )
    for r in rows:
        s = PrefillShape(**r["shape"])
        res = r["results"]
        cells = [
            _cell(res[n]["tflops"] * scale if "tflops" in res.get(n, {}) else None, w, ".1f")
            for n in names
        ]
        jf = res.get("jax_flash", {})
        cells += [_cell(ratio(jf, res.get(b, {}), "tflops"), wr, ".2f") for b in bases]
        print(f"{s.label():38s}" + "".join(cells))
    print(f"({unit}; causal counts half the FLOPs; '-': failed or skipped, see the log/JSON)")


# decode peers with a column in the table, and their short names
_DECODE_COLUMNS = {
    "pallas_best": "pallas",
    "fa3_paged_best": "fa3",
    "pallas_decode_contiguous": "pl-dec",
    "cudnn_contiguous": "cudnn",
    "jnp_gather": "gather",
}


def decode_table(rows, roof: dict):
    peers = {n: v for n, v in _DECODE_COLUMNS.items() if _measured(rows, n, "gbps")}
    ratios = [n for n in _DECODE_COLUMNS if n in peers and n != "jnp_gather"]
    print()
    print(
        f"{'shape':40s}{'jf us':>10s}{'jf GB/s':>9s}"
        + (f"{'%roof':>6s}" if roof else "")
        + f"{'jf tok/s':>10s}"
        + "".join(f"{v + ' GB/s':>13s}" for v in peers.values())
        + "".join(f"{'jf/' + peers[n]:>10s}" for n in ratios)
    )
    for r in rows:
        res = r["results"]
        jf = res.get("jax_flash", {})
        cells = _cell(jf.get("us"), 10, ".1f") + _num(jf.get("gbps"), 9)
        if roof:
            cells += _cell(jf.get("pct_roofline"), 6, ".1f")
        cells += _cell(jf.get("tokens_per_s"), 10, ".0f")
        cells += "".join(_num(res.get(n, {}).get("gbps"), 13) for n in peers)
        cells += "".join(_cell(ratio(jf, res.get(n, {}), "gbps"), 10, ".2f") for n in ratios)
        print(f"{DecodeShape(**r['shape']).label():40s}{cells}")
    print(
        "(GB/s: bytes of K, V and scales read / time"
        + (
            f"; %roof: of the measured HBM read bandwidth {roof['hbm_read_gbps']:.0f} GB/s"
            if roof
            else ""
        )
        + "; tok/s: B * Sq / time; '-': failed or skipped, see the log/JSON)"
    )


def decode_summary(rows, dtype) -> dict:
    """tokens/s of an int8 / fp8 cache (per-token scales; "_head": per-head scales) over the
    `dtype` cache at B=64 ctx=8k (GQA 32/8, D128, page 16, Sq 1), for jax_flash and the best
    Pallas, where both rows were measured; printed."""
    base = DecodeShape(64, 8192, 32, 8, 128, 16, dtype, dtype)
    by_shape = {DecodeShape(**r["shape"]): r["results"] for r in rows}
    summary = {}
    if base not in by_shape:
        return summary
    for sc in ("token", "head"):
        for cd in QUANTIZED:
            quant = by_shape.get(dataclasses.replace(base, cache_dtype=cd, scales=sc))
            if quant is None:
                continue
            name = short(cd) + ("_head" if sc == "head" else "")
            parts = []
            for impl in ("jax_flash", "pallas_best"):
                x = ratio(quant.get(impl, {}), by_shape[base].get(impl, {}), "tokens_per_s")
                if x is not None:
                    summary[f"{impl}_{name}_over_{short(dtype)}_tokens_per_s_B64_ctx8k"] = x
                    parts.append(f"{impl} {x:.2f}")
            if parts:
                print(
                    f"{short(cd)} cache ({sc} scales) tokens/s / {short(dtype)} cache tokens/s "
                    f"at B64 ctx8k: " + ", ".join(parts)
                )
    return summary
