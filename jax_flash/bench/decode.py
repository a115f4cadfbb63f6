"""The paged-decode grid and its run: paged attention over a paged KV cache (random page
permutation; int8 and float8_e4m3fn caches carry per-token-and-head float32 scales, as
`append_kv` writes them, or in the rows marked "/head" one scale per KV head) timed for jax_flash
and its peers. The figure of merit is the effective KV bandwidth: bytes of K and V (and scales)
read / time, also as % of the measured HBM read bandwidth, and tokens/s (B * Sq / time)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import reference
from jax_flash.bench import report, timing
from jax_flash.bench.peers import decode_peers, skipped
from jax_flash.bench.run import Run
from jax_flash.bench.shapes import QUANTIZED, DecodeShape

# The decode-speed grid: batch x context from one long sequence to many short ones.
BATCH_CTX = ((1, 131072), (1, 32768), (8, 8192), (32, 4096), (64, 8192), (128, 2048), (256, 1024))
_AROUND = ((64, 8192), (1, 32768), (256, 1024))  # where each other axis is varied

# Positions of the peer arguments (q, k, v, block_tables, kv_lens, k_scale, v_scale) that the
# timing loop chains: q and block_tables, so that a peer that gathers the pages cannot have the
# gather hoisted out of the loop.
CHAIN = (0, 3)


def _variations(base: DecodeShape) -> list[DecodeShape]:
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


def grid_shapes(name, device_kind, dtypes) -> list[DecodeShape]:
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
            for cd in QUANTIZED
        ]
        return list(dict.fromkeys(shapes))
    shapes = [base(dt, b, c) for dt in dtypes for b, c in BATCH_CTX]
    for b, c in _AROUND:
        shapes += _variations(base(dt0, b, c))
    return list(dict.fromkeys(shapes))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_pages(key, shape, dtype, cache_dtype, scales="token"):
    """Random normal pages; a quantized cache also gets its scales: per token and head
    ([num_pages, page_size, Hkv], amax / qmax as append_kv writes them) or per head ([Hkv], amax
    over the whole cache / qmax)."""
    if cache_dtype not in QUANTIZED:
        return jax.random.normal(key, shape, dtype), None
    x = jax.random.normal(key, shape, jnp.float32)
    if scales == "head":
        scale = reference.per_token_scale(x, cache_dtype).max(axis=(0, 1))
        return reference.quantize(x, scale[:, None], cache_dtype), scale
    scale = reference.per_token_scale(x, cache_dtype)
    return reference.quantize(x, scale[..., None], cache_dtype), scale


def make_paged(s: DecodeShape, key):
    """(q, k_pages, v_pages, block_tables, kv_lens, k_scale, v_scale) for shape s; scales None
    unless the cache is quantized. Each sequence's pages are a random permutation of the pool."""
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


def _calls(kind, name, s: DecodeShape, roof) -> int:
    """Calls per loop run, from the expected bandwidth of this kind of implementation."""
    slow = name == "jnp_gather"
    if kind == "gpu":
        bw = roof.get("hbm_read_gbps", 3000.0) * 1e9 * (0.3 if slow else 0.7)
        return timing.pick_n(s.kv_bytes / bw + 5e-6, 0.1, 5, 5000)
    bw = 1e10 * (0.05 if slow else 1.0)
    return timing.pick_n(s.kv_bytes / bw, 0.01, 1, 5)


def _time_peer(kind, name, fn, args, s: DecodeShape, roof, ref) -> dict:
    n = _calls(kind, name, s, roof)
    t, out = timing.loop_time(fn, args, n=n, chain=CHAIN)
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
        res["rel_err"] = report.rel_err(out, ref)
    return res


def _best_pallas(results: dict):
    """The Pallas k_splits (FA3 binding num_splits) with the highest bandwidth, as
    results["pallas_best"] (results["fa3_paged_best"])."""
    for prefix, best_name in (("pallas_k", "pallas_best"), ("fa3_paged_s", "fa3_paged_best")):
        group = {n: r for n, r in results.items() if n.startswith(prefix)}
        if group:
            ok = {n: r for n, r in group.items() if "gbps" in r}
            if ok:
                best = max(ok, key=lambda n: ok[n]["gbps"])
                results[best_name] = {**ok[best], "from": best}
            else:
                results[best_name] = {"error": next(iter(group.values()))["error"]}


def run_decode(grid="quick", dtypes=("bfloat16",), out_dir=None, shapes=None, skip=()):
    """Times the grid (or `shapes`), prints a line per peer, the table and the 8-bit summary;
    with `out_dir`, writes the run's JSON and PNG there. Returns the result dict (as saved)."""
    run = Run("decode", grid, out_dir)
    kind, mem, roof = run.kind, run.mem, run.roof
    shapes = grid_shapes(grid, kind, dtypes) if shapes is None else list(shapes)
    for i, s in run.shapes(shapes):
        data = make_paged(s, jax.random.key(2000 + i))
        ref = None
        if 1.5 * s.gather_bytes < 0.5 * mem:
            q, kp, vp, bt, kl, ks, vs = data
            try:
                ref = jax.jit(reference.paged_attention)(
                    q.astype(jnp.float32), kp, vp, bt, kl, k_scale=ks, v_scale=vs
                )
                ref = np.asarray(ref)
            except Exception as e:  # no reference: results without rel_err
                print(f"    (no float32 reference: {report.error_text(e)})", flush=True)
        row = {"shape": dataclasses.asdict(s), "results": {}}
        row["harness_us"] = run.harness_us(data, CHAIN)
        for make_args, group in decode_peers(kind, s, mem):
            args = None
            for name, fn in group.items():
                if skipped(name, skip):
                    continue
                if isinstance(fn, str):
                    res = {"error": fn}
                else:
                    try:
                        if args is None:
                            args = make_args(data)
                        res = _time_peer(kind, name, fn, args, s, roof, ref)
                    except Exception as e:  # a peer that cannot run this shape
                        res = {"error": report.error_text(e)}
                row["results"][name] = res
                report.decode_line(name, res)
            del args
        _best_pallas(row["results"])
        run.add(row)
        del data, ref
    report.decode_table(run.rows, roof)
    return run.finish(summary=report.decode_summary(run.rows, dtypes[0]))
