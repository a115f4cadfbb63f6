"""PNG plots of a run's result: prefill TFLOP/s against sequence length, one panel per head
config; decode effective KV bandwidth per row, one bar per implementation."""

from __future__ import annotations

import functools
import math

import numpy as np

from jax_flash.bench.shapes import DecodeShape


def prefill(plt, result, title="prefill attention"):
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
    fig.suptitle(f"{title}, {result['info']['device']}")
    fig.tight_layout()
    return fig


def decode(plt, result):
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


PLOTS = {
    "prefill": prefill,
    "decode": decode,
    "backward": functools.partial(prefill, title="attention forward + backward"),
}
