"""Where a kernel's warps stall, line by line of its SASS, from Nsight Compute's source page:

    ncu --import OUT.ncu-rep --page source --print-source sass --csv > OUT.csv
    python tools/gpu/ncu_hotspots.py OUT.csv [--top 25]

Prints the stall reasons' shares of all warp samples, the SASS lines holding the most samples
(with their two main reasons), and the lines with the most excess shared-memory wavefronts (bank
conflicts). Plain Python: runs anywhere the CSV is (tools/gpu/ncu_call.py says how to make it).
"""

from __future__ import annotations

import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS = "L1 Wavefronts Shared Excessive"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """The kernel's name line and its SASS rows (column name -> text) from a source-page CSV."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if header_at is None:
        raise SystemExit(f"ncu_hotspots: {path} has no '{SAMPLES}' column (a --page source CSV?)")
    header = rows[header_at]
    body = [r for r in rows[header_at + 1 :] if r]
    return rows[:header_at], [dict(zip(header, r, strict=True)) for r in body]


def report(rows: list[dict[str, str]], top: int = 25) -> str:
    reasons = sorted(
        {k for r in rows[:1] for k in r if k.startswith("stall_") and "Not Issued" not in k}
    )
    total = sum(_number(r.get(SAMPLES, "")) for r in rows) or 1.0
    by_reason = {k[len("stall_") :]: sum(_number(r[k]) for r in rows) for k in reasons}
    out = [f"{len(rows)} SASS lines, {total:.0f} warp samples"]
    out += [
        f"  {name:24s} {n / total:6.1%}"
        for name, n in sorted(by_reason.items(), key=lambda kv: -kv[1])
        if n > 0
    ][:12]
    out.append(f"lines with the most samples (top {top}, in program order):")
    hot = sorted(range(len(rows)), key=lambda i: -_number(rows[i].get(SAMPLES, "")))[:top]
    for i in sorted(hot):
        r = rows[i]
        main = sorted(((_number(r[k]), k[len("stall_") :]) for k in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {n:.0f}" for n, name in main if n > 0)
        share = _number(r.get(SAMPLES, "")) / total
        out.append(f"  {i:5d} {share:6.1%}  {r.get('Source', '').strip()[:64]:64s} {why}")
    conflicted = [r for r in rows if _number(r.get(EXCESS, "")) > 0]
    if conflicted:
        out.append("lines with excess shared-memory wavefronts (bank conflicts):")
        for r in sorted(conflicted, key=lambda r: -_number(r[EXCESS]))[:top]:
            shared = _number(r.get("L1 Wavefronts Shared", ""))
            source = r.get("Source", "").strip()[:64]
            out.append(f"  {_number(r[EXCESS]):14.0f} of {shared:14.0f}  {source}")
    return "\n".join(out)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    preamble, rows = read(args.csv)
    for line in preamble:
        print(" ".join(line)[:160])
    print(report(rows, args.top))


if __name__ == "__main__":
    main(sys.argv[1:])
