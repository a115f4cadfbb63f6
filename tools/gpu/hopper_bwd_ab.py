"""The two CUDA backward kernels side by side in one build: the Hopper kernel (default on compute
capability 9.0) and the mma.sync kernel, picked per call by the backward's launch options
(FlashBwdLaunch.hopper_kernel "hopper" / "mma"), on the same inputs. Per shape: fwd+bwd TFLOP/s
of each (3.5x the forward's FLOPs, causal half, as `python -m jax_flash.bench backward` counts),
the largest relative difference of their dq / dk / dv, and, where it fits, each one's error
against the float32 reference.

    python tools/gpu/hopper_bwd_ab.py            # the issue's shapes (bf16, 32/8 heads, 4 x 4k)
    python tools/gpu/hopper_bwd_ab.py --kernels hopper --long   # Hopper only, + 1 x 16k causal
    python tools/gpu/hopper_bwd_ab.py --wide     # + head dim 256 (the 256-wide tile), 4 x 4k
    python tools/gpu/hopper_bwd_ab.py --kernels hopper --sets wide padded   # the 256-wide tile only
    python tools/gpu/hopper_bwd_ab.py --kernels hopper --sets narrow   # D 80 / 96 / 112, 128-wide

Per shape and kernel also the deterministic mode's cost against the fast mode and whether a
second deterministic run is bit-identical to the first (it must be).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import bench, reference
from jax_flash.primitives.flash_attention import FlashBwdLaunch

SHAPES = [  # batch, seqlen, heads_q, heads_kv, head_dim, causal
    (4, 4096, 32, 8, 128, True),
    (4, 4096, 32, 8, 128, False),
    (4, 4096, 32, 8, 64, True),
    # small and off the tiles, also checked against the reference; sequences start at rows 999
    # and 1998, off the 16-byte rows a TMA box may start at (the lse / Delta boxes round down)
    (3, 999, 8, 2, 128, True),
]
LONG = [(1, 16384, 32, 8, 128, True)]
# The 256-wide tile (both kernels), and off the tiles against the reference.
WIDE = [
    (4, 4096, 32, 8, 256, True),
    (4, 4096, 32, 8, 256, False),
    (2, 777, 8, 2, 256, True),
]
# Head dims the 256-wide tile takes padded (D, Dv < 256), 4 x 4k causal: (..., head_dim, causal, Dv)
PADDED = [
    (4, 4096, 32, 8, 192, True, 128),
    (4, 4096, 32, 8, 160, True, 160),
]
# Head dims the 128-wide tile takes padded, 4 x 4k causal
NARROW = [
    (4, 4096, 32, 8, 80, True),
    (4, 4096, 32, 8, 96, True),
    (4, 4096, 32, 8, 112, True),
]
KERNELS = {"hopper": "hopper", "mma.sync": "mma"}  # name -> FlashBwdLaunch kernel


def _fwd_bwd(f):
    def run(q, k, v, do):
        _, vjp = jax.vjp(f, q, k, v)
        return vjp(do)

    return run


def _rel(a, b) -> float:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--long", action="store_true", help="also 1 x 16k causal")
    parser.add_argument("--wide", action="store_true", help="also head dim 256")
    parser.add_argument(
        "--sets", nargs="+", choices=["issue", "long", "wide", "padded", "narrow"],
        help="the shape sets to run (default: the issue's, and those --long / --wide add)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    device = jax.devices()[0].device_kind
    print(device, flush=True)
    rows = []
    sets = dict(issue=SHAPES, long=LONG, wide=WIDE, padded=PADDED, narrow=NARROW)
    names = args.sets or ["issue"] + ["long"] * args.long + ["wide"] * args.wide
    shapes = [shape for name in names for shape in sets[name]]
    for b, s, hq, hkv, d, causal, *rest in shapes:
        dv = rest[0] if rest else d
        keys = jax.random.split(jax.random.key(s + d), 4)
        q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, hkv, dv), jnp.bfloat16)
        do = jax.random.normal(keys[3], (b, s, hq, dv), jnp.bfloat16)
        flops = 3.5 * 2 * b * hq * s * s * (d + dv) * (0.5 if causal else 1.0)
        ref = None
        if s <= 1024:
            f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
            attn = functools.partial(reference.attention, causal=causal)
            ref = jax.jit(_fwd_bwd(attn))(*f32)
        outs = {}
        for name in args.kernels:
            rate = {}
            for det in (False, True):
                fn = functools.partial(
                    jax_flash.flash_attention, causal=causal, deterministic=det,
                    _bwd_launch=FlashBwdLaunch(KERNELS[name], strict=True),  # no silent mma.sync
                )  # fmt: skip
                t, out = bench.loop_time(_fwd_bwd(fn), (q, k, v, do), n=10, chain=(0, 1, 2))
                rate[det] = flops / t / 1e12
                run = jax.jit(_fwd_bwd(fn))
                out = run(q, k, v, do)  # unchained: comparable outputs
                outs[name, det] = out
                line = f"  {name:9s} det={int(det)} {rate[det]:7.1f} TFLOP/s"
                if ref is not None:
                    line += f"  err {max(_rel(o, r) for o, r in zip(out, ref, strict=True)):.2e}"
                if det:
                    again = run(q, k, v, do)
                    same = all(
                        np.array_equal(np.asarray(a), np.asarray(c))
                        for a, c in zip(out, again, strict=True)
                    )
                    line += f"  cost {100 * (1 - rate[True] / rate[False]):.1f}%"
                    line += f"  rerun {'bit-identical' if same else 'DIFFERS'}"
                print(line, flush=True)
                rows.append(
                    dict(batch=b, seqlen=s, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=dv,
                         causal=causal, kernel=name, deterministic=det, tflops=rate[det],
                         rerun_identical=same if det else None)
                )  # fmt: skip
        shape = f"B={b} S={s} H={hq}/{hkv} D={d}/{dv} causal={causal}"
        if len(args.kernels) == 2:
            diff = max(
                _rel(a, c)
                for a, c in zip(outs["hopper", False], outs["mma.sync", False], strict=True)
            )
            print(f"{shape}: hopper vs mma.sync {diff:.2e}")
        else:
            print(shape)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=device, jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
