"""jax_flash.bench: the timing loop, the grids, and small end-to-end runs on this platform."""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import bench


def test_loop_returns_the_call_and_updates_in_place():
    """The timing loop returns fn's output on the original inputs, and the per-call dependency
    is a one-element update of the chained args: no copy of them inside the loop body."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 64, 4, 32), jnp.float32)
    k = jax.random.normal(keys[1], (1, 64, 2, 32), jnp.float32)
    v = jax.random.normal(keys[2], (1, 64, 2, 32), jnp.float32)
    fn = functools.partial(jax_flash.flash_attention, causal=True)
    loop = bench._loop_fn(fn, (q, k, v), 3, (0, 1, 2))
    np.testing.assert_array_equal(np.asarray(loop(q, k, v)), np.asarray(jax.jit(fn)(q, k, v)))

    hlo = loop.lower(q, k, v).compile().as_text()
    body = re.search(r"while\(.*?body=(%[\w.\-]+)", hlo).group(1)
    block = hlo[hlo.index("\n" + body + " (") :]
    block = block[: block.index("\n}\n")]
    copies = [ln for ln in block.splitlines() if re.search(r"= f32\[1,64,\d,32\][^=]* copy\(", ln)]
    assert not copies, copies


def test_bump_is_zero_for_finite_outputs():
    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    y = bench._bump(x, bench._corner(x), jnp.isnan(jnp.float32(1.0)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    bt = jnp.arange(4, dtype=jnp.int32).reshape(1, 4)
    np.testing.assert_array_equal(
        np.asarray(bench._bump(bt, bench._corner(bt), jnp.isnan(jnp.float32(2.0)))), bt
    )


def test_decode_grids():
    full = bench._decode_grid("full", "gpu", ("bfloat16",))
    assert 35 <= len(full) <= 50 and len(set(full)) == len(full)
    base = [s for s in full if (s.heads_q, s.heads_kv, s.head_dim, s.page_size) == (32, 8, 128, 16)]
    bc = {(s.batch, s.ctx) for s in base if s.dtype == s.cache_dtype == "bfloat16"}
    assert bc >= set(bench._DECODE_BC)
    assert {(s.heads_q, s.heads_kv) for s in full} == {(32, 8), (32, 32), (64, 8), (28, 4)}
    assert {s.head_dim for s in full} == {64, 128, 256}
    assert {s.page_size for s in full} == {16, 64}
    assert {s.seqlen_q for s in full} == {1, 4}
    assert {(s.dtype, s.cache_dtype) for s in full} == {
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("bfloat16", "int8"),
        ("bfloat16", "float8_e4m3fn"),
    }
    assert {(s.cache_dtype, s.scales) for s in full if s.quantized} == {
        ("int8", "token"),
        ("float8_e4m3fn", "token"),
        ("float8_e4m3fn", "head"),
    }
    quick = bench._decode_grid("quick", "gpu", ("bfloat16",))
    assert {(s.cache_dtype, s.scales) for s in quick if (s.batch, s.ctx) == (64, 8192)} == {
        ("bfloat16", "token"),
        ("int8", "token"),
        ("float8_e4m3fn", "token"),
        ("int8", "head"),
        ("float8_e4m3fn", "head"),
    }


def test_prefill_grid():
    full = bench._grid("full", "gpu", ("bfloat16",))
    assert len(full) <= 60
    labels = {s.label() for s in full}
    for d in (64, 128, 256):
        for hkv in (8, 32):
            assert f"bf16 B1 S16k H32/{hkv} D{d} causal" in labels
    assert "bf16 B4 S4k H32/8 D128 causal" in labels and "bf16 B4 S4k H32/8 D128 full" in labels


def test_kv_bytes_count_scales():
    s = bench.DecodeShape(2, 1024, 8, 2, 128, 16, "bfloat16", "bfloat16")
    assert s.kv_bytes == 2 * 2 * 1024 * 2 * 128 * 2
    q8 = dataclasses.replace(s, cache_dtype="int8")
    assert q8.kv_bytes == 2 * 2 * 1024 * 2 * (128 + 4)
    assert dataclasses.replace(s, cache_dtype="float8_e4m3fn").kv_bytes == q8.kv_bytes
    head = dataclasses.replace(q8, scales="head")  # [Hkv] scales: no bytes per token
    assert head.kv_bytes == 2 * 2 * 1024 * 2 * 128
    assert head.label() == "bf16/int8/head B2 ctx1k H8/2 D128 p16 Sq1"


def test_prefill_runs(tmp_path):
    shapes = [
        bench.PrefillShape(1, 128, 4, 2, 64, True, "bfloat16"),
        bench.PrefillShape(1, 128, 4, 4, 64, False, "float16"),
    ]
    result = bench.run_prefill(out_dir=str(tmp_path), shapes=shapes)
    for row in result["rows"]:
        jf = row["results"]["jax_flash"]
        assert jf["ms"] > 0 and jf["rel_err"] < 2e-2, jf
        assert "tflops" in row["results"]["jnp_reference"]
        assert row["harness_us"] > 0
    saved = list(tmp_path.glob("prefill_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["benchmark"] == "prefill"


def test_decode_runs(tmp_path):
    s = bench.DecodeShape(2, 256, 4, 2, 64, 16, "bfloat16", "bfloat16")
    shapes = [
        s,
        dataclasses.replace(s, cache_dtype="int8"),
        dataclasses.replace(s, cache_dtype="float8_e4m3fn"),
        dataclasses.replace(s, cache_dtype="float8_e4m3fn", scales="head"),
        dataclasses.replace(s, cache_dtype="int8", scales="head"),
        dataclasses.replace(s, seqlen_q=4),
        dataclasses.replace(s, page_size=64),
    ]
    result = bench.run_decode(out_dir=str(tmp_path), shapes=shapes)
    for row in result["rows"]:
        for name in ("jax_flash", "jnp_gather"):
            r = row["results"][name]
            assert r["us"] > 0 and r["gbps"] > 0 and r["tokens_per_s"] > 0, r
            assert r["rel_err"] < 2e-2, (row["shape"], name, r)
    saved = list(tmp_path.glob("decode_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["benchmark"] == "decode"


def test_decode_summary():
    base = bench.DecodeShape(64, 8192, 32, 8, 128, 16, "bfloat16", "bfloat16")
    rows = [
        {"shape": dataclasses.asdict(s), "results": {"jax_flash": {"tokens_per_s": t}}}
        for s, t in (
            (base, 100.0),
            (dataclasses.replace(base, cache_dtype="float8_e4m3fn"), 180.0),
            (dataclasses.replace(base, cache_dtype="int8"), 150.0),
            (dataclasses.replace(base, cache_dtype="float8_e4m3fn", scales="head"), 190.0),
        )
    ]
    summary = bench._decode_summary(rows, "bfloat16")
    assert summary["jax_flash_fp8_over_bf16_tokens_per_s_B64_ctx8k"] == pytest.approx(1.8)
    assert summary["jax_flash_int8_over_bf16_tokens_per_s_B64_ctx8k"] == pytest.approx(1.5)
    assert summary["jax_flash_fp8_head_over_bf16_tokens_per_s_B64_ctx8k"] == pytest.approx(1.9)
    assert "jax_flash_int8_head_over_bf16_tokens_per_s_B64_ctx8k" not in summary


def test_cli(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_decode", lambda *a, **k: calls.append(("decode", a, k)))
    monkeypatch.setattr(bench, "run_prefill", lambda *a, **k: calls.append(("prefill", a, k)))
    bench.main(["decode", "--grid", "full", "--dtype", "float16", "--out", "x"])
    bench.main(["prefill", "--skip", "xla_dpa"])
    assert calls == [
        ("decode", ("full", ("float16",), "x"), {"skip": ()}),
        ("prefill", ("quick", ("bfloat16",), None), {"skip": ("xla_dpa",)}),
    ]
    assert bench._skipped("pallas_k4", ("pallas",)) and not bench._skipped("jax_flash", ("j",))
