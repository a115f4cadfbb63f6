"""Deterministic-mode gradients of the flash ops on calls off the tiles, saved for a bitwise
comparison between two builds (a change that keeps the order of every sum must keep the bits).

    python tools/gpu/det_grads.py OUT.npz                       # this build's gradients
    python tools/gpu/use_build.py /tmp/base tools/gpu/det_grads.py BASE.npz
    python tools/gpu/det_grads.py --compare OUT.npz BASE.npz    # bit-identical, or what differs

Each call's gradients are computed twice in the process and must be bit-identical run to run
(printed). Cases: D 128 causal GQA, Sq != Sk, D 64 with a window, a soft cap, D 80, D 192/128,
a 4k causal call, and varlen with empty and one-row sequences; bf16 / fp16, the CUDA kernels.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

CASES = [  # name, batch, sq, sk, hq, hkv, d, dv, dtype, options
    ("d128_causal_gqa", 2, 1000, 1000, 8, 2, 128, 128, jnp.bfloat16, dict(causal=True)),
    ("d128_sq_ne_sk", 2, 333, 1301, 8, 4, 128, 128, jnp.float16, dict(causal=True)),
    ("d64_window", 2, 777, 777, 6, 3, 64, 64, jnp.bfloat16,
     dict(causal=True, sliding_window=(200, 0))),
    ("d128_softcap", 1, 640, 640, 4, 1, 128, 128, jnp.bfloat16,
     dict(causal=False, logits_soft_cap=30.0)),
    ("d80_causal", 2, 515, 515, 4, 2, 80, 80, jnp.bfloat16, dict(causal=True)),
    ("d192_128", 1, 500, 500, 4, 2, 192, 128, jnp.bfloat16, dict(causal=True)),
    ("d128_4k", 1, 4096, 4096, 8, 2, 128, 128, jnp.bfloat16, dict(causal=True)),
]  # fmt: skip
VARLEN_LENS = [0, 130, 1, 64, 500, 129, 0, 257]


def _twice(fn, *args):
    g = jax.jit(fn)
    a, b = g(*args), g(*args)
    same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))
    return a, same


def _keep(out, name, grads):
    for n, x in zip("qkv", grads, strict=True):
        out[f"{name}_d{n}"] = np.asarray(x.astype(jnp.float32))


def gradients() -> dict[str, np.ndarray]:
    out = {}
    for name, b, sq, sk, hq, hkv, d, dv, dtype, options in CASES:
        ks = jax.random.split(jax.random.key(sq + d), 4)
        q = jax.random.normal(ks[0], (b, sq, hq, d), dtype)
        k = jax.random.normal(ks[1], (b, sk, hkv, d), dtype)
        v = jax.random.normal(ks[2], (b, sk, hkv, dv), dtype)
        do = jax.random.normal(ks[3], (b, sq, hq, dv), dtype)
        f = functools.partial(
            jax_flash.flash_attention, deterministic=True, implementation="cuda", **options
        )
        grads, same = _twice(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do), q, k, v, do)
        print(f"{name}: rerun {'bit-identical' if same else 'DIFFERS'}", flush=True)
        _keep(out, name, grads)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(VARLEN_LENS)]), jnp.int32)
    total = int(cu[-1])
    ks = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(ks[0], (total, 8, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (total, 2, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (total, 2, 128), jnp.bfloat16)
    do = jax.random.normal(ks[3], (total, 8, 128), jnp.bfloat16)

    def varlen(q, k, v):
        return jax_flash.flash_attention_varlen(
            q, k, v, cu, cu, causal=True, deterministic=True, implementation="cuda"
        )

    grads, same = _twice(lambda q, k, v, do: jax.vjp(varlen, q, k, v)[1](do), q, k, v, do)
    print(f"varlen: rerun {'bit-identical' if same else 'DIFFERS'}", flush=True)
    _keep(out, "varlen", grads)
    return out


def compare(path_a: str, path_b: str) -> bool:
    a, b = np.load(path_a), np.load(path_b)
    differ = 0
    for key in a.files:
        if not np.array_equal(a[key], b[key]):
            differ += 1
            diff = np.abs(a[key] - b[key])
            print(f"{key}: DIFFERS, {int((diff > 0).sum())} elements, largest {diff.max():.3g}")
    print(f"{len(a.files) - differ} of {len(a.files)} arrays bit-identical")
    return differ == 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="where to save this build's gradients (.npz)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args(argv)
    if args.compare:
        raise SystemExit(0 if compare(*args.compare) else 1)
    if not args.out:
        parser.error("OUT.npz or --compare A B")
    np.savez(args.out, **gradients())


if __name__ == "__main__":
    main()
