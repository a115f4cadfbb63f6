"""jax_flash.bench: the timing loop, the grids, the report, the files a run saves, and small
end-to-end runs on this platform."""

import dataclasses
import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import bench
from jax_flash.bench import cli, decode, peers, prefill, report, timing


def test_loop_returns_the_call_and_updates_in_place():
    """The timing loop returns fn's output on the original inputs, and the per-call dependency
    is a one-element update of the chained args: no copy of them inside the loop body."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 64, 4, 32), jnp.float32)
    k = jax.random.normal(keys[1], (1, 64, 2, 32), jnp.float32)
    v = jax.random.normal(keys[2], (1, 64, 2, 32), jnp.float32)
    fn = functools.partial(jax_flash.flash_attention, causal=True)
    loop = timing.chained_loop(fn, (q, k, v), 3, (0, 1, 2))
    np.testing.assert_array_equal(np.asarray(loop(q, k, v)), np.asarray(jax.jit(fn)(q, k, v)))

    hlo = loop.lower(q, k, v).compile().as_text()
    body = re.search(r"while\(.*?body=(%[\w.\-]+)", hlo).group(1)
    block = hlo[hlo.index("\n" + body + " (") :]
    block = block[: block.index("\n}\n")]
    copies = [ln for ln in block.splitlines() if re.search(r"= f32\[1,64,\d,32\][^=]* copy\(", ln)]
    assert not copies, copies


def test_bump_is_zero_for_finite_outputs():
    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    y = timing._bump(x, timing._corner(x), jnp.isnan(jnp.float32(1.0)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    bt = jnp.arange(4, dtype=jnp.int32).reshape(1, 4)
    np.testing.assert_array_equal(
        np.asarray(timing._bump(bt, timing._corner(bt), jnp.isnan(jnp.float32(2.0)))), bt
    )


def test_decode_grids():
    full = decode.grid_shapes("full", "gpu", ("bfloat16",))
    assert 35 <= len(full) <= 50 and len(set(full)) == len(full)
    base = [s for s in full if (s.heads_q, s.heads_kv, s.head_dim, s.page_size) == (32, 8, 128, 16)]
    bc = {(s.batch, s.ctx) for s in base if s.dtype == s.cache_dtype == "bfloat16"}
    assert bc >= set(decode.BATCH_CTX)
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
    quick = decode.grid_shapes("quick", "gpu", ("bfloat16",))
    assert {(s.cache_dtype, s.scales) for s in quick if (s.batch, s.ctx) == (64, 8192)} == {
        ("bfloat16", "token"),
        ("int8", "token"),
        ("float8_e4m3fn", "token"),
        ("int8", "head"),
        ("float8_e4m3fn", "head"),
    }


def test_prefill_grid():
    full = prefill.grid_shapes("full", "gpu", ("bfloat16",))
    assert len(full) <= 60
    labels = {s.label() for s in full}
    for d in (64, 128, 256):
        for hkv in (8, 32):
            assert f"bf16 B1 S16k H32/{hkv} D{d} causal" in labels
    assert "bf16 B4 S4k H32/8 D128 causal" in labels and "bf16 B4 S4k H32/8 D128 full" in labels
    peers = {s.label() for s in prefill.grid_shapes("peers", "gpu", ("bfloat16", "float16"))}
    for dt in ("bf16", "fp16"):
        for shape in ("B16 S1k", "B4 S4k", "B2 S8k"):
            assert (
                f"{dt} {shape} H32/8 D128 causal" in peers
                and f"{dt} {shape} H32/8 D128 full" in peers
            )
        assert f"{dt} B4 S4k H32/8 D64 causal" in peers and f"{dt} B4 S4k H32/8 D256 full" in peers


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


def test_backward_runs(tmp_path):
    shapes = [bench.PrefillShape(1, 96, 4, 2, 64, True, "float32")]
    result = bench.run_backward(out_dir=str(tmp_path), shapes=shapes)
    (row,) = result["rows"]
    for name in ("jax_flash", "jax_flash_det"):
        res = row["results"][name]
        assert res["ms"] > 0 and res["rel_err"] < 1e-4, (name, res)
    assert "tflops" in row["results"]["xla_dpa"]
    saved = list(tmp_path.glob("backward_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["benchmark"] == "backward"


def test_backward_grid():
    labels = {s.label() for s in bench.backward.grid_shapes("full", "gpu", ("bfloat16",))}
    for causal in ("causal", "full"):
        for d in (64, 128, 256):
            assert f"bf16 B4 S4k H32/8 D{d} {causal}" in labels
        assert f"bf16 B1 S16k H32/8 D128 {causal}" in labels


def test_decode_runs(tmp_path):
    s = bench.DecodeShape(2, 256, 4, 2, 64, 16, "bfloat16", "bfloat16")
    # Each cache dtype and scale mode once, several query tokens, another page size.
    shapes = [
        s,
        dataclasses.replace(s, cache_dtype="int8"),
        dataclasses.replace(s, cache_dtype="float8_e4m3fn", scales="head"),
        dataclasses.replace(s, seqlen_q=4, page_size=64),
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
    summary = report.decode_summary(rows, "bfloat16")
    assert summary["jax_flash_fp8_over_bf16_tokens_per_s_B64_ctx8k"] == pytest.approx(1.8)
    assert summary["jax_flash_int8_over_bf16_tokens_per_s_B64_ctx8k"] == pytest.approx(1.5)
    assert summary["jax_flash_fp8_head_over_bf16_tokens_per_s_B64_ctx8k"] == pytest.approx(1.9)
    assert "jax_flash_int8_head_over_bf16_tokens_per_s_B64_ctx8k" not in summary


def test_cli(monkeypatch):
    calls = []
    for name in ("decode", "prefill"):
        fake = lambda *a, name=name, **k: calls.append((name, a, k))  # noqa: E731
        monkeypatch.setitem(cli.BENCHMARKS, name, fake)
    bench.main(["decode", "--grid", "full", "--dtype", "float16", "--out", "x"])
    bench.main(["prefill", "--skip", "xla_dpa"])
    bench.main(["prefill", "--no-save"])
    assert calls == [
        ("decode", ("full", ("float16",), "x"), {"skip": ()}),
        ("prefill", ("quick", ("bfloat16",), "bench-results"), {"skip": ("xla_dpa",)}),
        ("prefill", ("quick", ("bfloat16",), None), {"skip": ()}),
    ]
    assert peers.skipped("pallas_k4", ("pallas",)) and not peers.skipped("jax_flash", ("j",))


def test_cli_saves_json_and_png_by_default(monkeypatch, tmp_path, capsys):
    """Without --out the command saves its JSON and PNG under bench-results/ in the working
    directory and prints where (it used to write nothing unless --out was given)."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    tiny = [bench.DecodeShape(2, 64, 4, 2, 32, 16, "float32", "float32")]
    monkeypatch.setattr(decode, "grid_shapes", lambda *a: tiny)
    bench.main(["decode", "--skip", "jnp_gather"])
    out = capsys.readouterr().out
    saved = sorted(p.name for p in (tmp_path / bench.DEFAULT_OUT).iterdir())
    assert [p.rsplit(".", 1)[1] for p in saved] == ["json", "png"], saved
    stem = saved[0].rsplit(".", 1)[0]
    assert f"saved {bench.DEFAULT_OUT}/{stem}.json" in out and f"{stem}.png" in out
    result = json.loads((tmp_path / bench.DEFAULT_OUT / saved[0]).read_text())
    assert "partial" not in result and len(result["rows"]) == 1


def test_cli_no_save_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    tiny = [bench.PrefillShape(1, 32, 2, 1, 16, True, "float32")]
    monkeypatch.setattr(prefill, "grid_shapes", lambda *a: tiny)
    bench.main(["prefill", "--no-save"])
    assert list(tmp_path.iterdir()) == []


def _row(shape, **results):
    return {"shape": dataclasses.asdict(shape), "results": results}


def test_decode_table_shows_only_what_was_measured(capsys):
    """A CPU run measures no Pallas or cuDNN: their columns and the ratios against them are left
    out (they printed `nan`), and a peer that failed on one row is a dash there."""
    s = bench.DecodeShape(8, 1024, 8, 2, 128, 16, "bfloat16", "bfloat16")
    jf = {"us": 1000.0, "gbps": 8.1, "tokens_per_s": 7756.0}
    rows = [
        _row(s, jax_flash=jf, jnp_gather={"us": 9e4, "gbps": 0.07, "tokens_per_s": 80.0}),
        _row(dataclasses.replace(s, batch=1), jax_flash=jf, jnp_gather={"error": "skipped: x"}),
    ]
    report.decode_table(rows, {})
    out = capsys.readouterr().out
    assert "nan" not in out
    header, first, second = out.strip().splitlines()[:3]
    assert "gather GB/s" in header and "pallas" not in header and "cudnn" not in header
    assert "%roof" not in header
    assert second.split()[-1] == "-" and first.split()[-1] == "0.07"


def test_decode_table_ratios_on_gpu_rows(capsys):
    s = bench.DecodeShape(64, 8192, 32, 8, 128, 16, "bfloat16", "bfloat16")
    jf = {"us": 700.0, "gbps": 3000.0, "tokens_per_s": 9e4, "pct_roofline": 94.0}
    rows = [
        _row(s, jax_flash=jf, pallas_best={"gbps": 2400.0}, cudnn_contiguous={"gbps": 3060.0}),
        _row(
            dataclasses.replace(s, cache_dtype="int8"), jax_flash=jf, pallas_best={"gbps": 1000.0}
        ),
    ]
    report.decode_table(rows, {"hbm_read_gbps": 3196.0})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[-2:] == ["jf/pallas", "jf/cudnn"] and "%roof" in lines[0]
    assert lines[1].split()[-2:] == ["1.25", "0.98"]
    assert lines[2].split()[-2:] == ["3.00", "-"]  # no cuDNN on an int8 cache: a dash
    assert "nan" not in "\n".join(lines) and "3196 GB/s" in lines[-1]


def test_prefill_table_dashes(capsys):
    s = bench.PrefillShape(1, 512, 8, 2, 128, True, "bfloat16")
    rows = [_row(s, jax_flash={"tflops": 0.02}, xla_dpa={"error": "x"})]
    report.prefill_table(rows, "cpu")  # jnp_reference skipped (--skip): no ratio column
    header, line = capsys.readouterr().out.strip().splitlines()[:2]
    assert "jf/" not in header and line.split()[-1] == "-" and "nan" not in line


def test_decode_summary_without_pallas_has_no_nan(capsys):
    base = bench.DecodeShape(64, 8192, 32, 8, 128, 16, "bfloat16", "bfloat16")
    q8 = dataclasses.replace(base, cache_dtype="int8")
    rows = [
        _row(base, jax_flash={"tokens_per_s": 100.0}, pallas_best={"error": "skipped"}),
        _row(q8, jax_flash={"tokens_per_s": 170.0}, pallas_best={"error": "skipped"}),
    ]
    summary = report.decode_summary(rows, "bfloat16")
    assert summary == {"jax_flash_int8_over_bf16_tokens_per_s_B64_ctx8k": pytest.approx(1.7)}
    out = capsys.readouterr().out
    assert "jax_flash 1.70" in out and "nan" not in out and "pallas" not in out


def test_loop_chains_integer_outputs():
    """An integer output (sampled token ids) feeds the chain through a flag XLA cannot fold, and
    the loop returns the call's output on the original inputs."""
    logits = jax.random.normal(jax.random.key(1), (3, 37), jnp.float32)
    key = jax.random.key(2)
    fn = functools.partial(jax_flash.sample, temperature=0.8, top_k=5)
    loop = timing.chained_loop(fn, (logits, key), 4, (0,))
    np.testing.assert_array_equal(np.asarray(loop(logits, key)), np.asarray(fn(logits, key)))
    t, out = bench.auto_loop_time(fn, (logits, key), chain=(0,), target=0.01)
    assert t > 0 and out.dtype == jnp.int32 and out.shape == (3,)


def test_median_of_runs():
    calls = []

    def run():
        calls.append(len(calls))
        return len(calls), 0.1 * len(calls), 2.0

    result, a, b = bench.median_of_runs(run, 3)
    assert len(calls) == 4 and result == 4  # one warm-up run, then three timed
    assert a == pytest.approx(0.3) and b == 2.0


def test_tools_use_only_public_helpers():
    """Benchmarks and tools outside the package import no private name of jax_flash.bench."""
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    for path in [*root.glob("benchmarks/*.py"), *root.glob("tools/*.py")]:
        text = path.read_text()
        assert not re.search(r"bench\._\w", text), path
        assert not re.search(r"from jax_flash\.bench\.\w+ import", text), path


def test_module_entry_point_runs():
    """`python -m jax_flash.bench --help` works (the package's __main__)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "jax_flash.bench", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "prefill" in done.stdout and "--no-save" in done.stdout


def test_use_build_imports_the_named_build(tmp_path):
    """tools/gpu/use_build.py: the command it runs imports jax_flash from the folder named, not
    from the install of the environment (an editable one included), as module and as script."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    fake = tmp_path / "build" / "jax_flash"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("MARK = 'the other build'\n")
    (tmp_path / "build" / "show_mark.py").write_text(
        "import sys, jax_flash\nprint(jax_flash.MARK, sys.argv[1:])\n"
    )
    tool = str(root / "tools" / "gpu" / "use_build.py")
    build = str(tmp_path / "build")
    for how in (["-m", "show_mark"], [str(tmp_path / "build" / "show_mark.py")]):
        done = subprocess.run(
            [sys.executable, tool, build, *how, "--flag", "1"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "the other build ['--flag', '1']"
        assert f"jax_flash from {fake / '__init__.py'}" in done.stderr


def test_ncu_hotspots_reads_a_source_page(tmp_path):
    """tools/gpu/ncu_hotspots.py on a small CSV shaped as ncu's `--page source --csv`: the stall
    shares, the hottest line with its main reason, and the bank-conflicted store."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "ncu_hotspots", root / "tools" / "gpu" / "ncu_hotspots.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    header = ["Address", "Source", tool.SAMPLES, "stall_barrier", "stall_wait",
              "stall_barrier (Not Issued)", tool.EXCESS, "L1 Wavefronts Shared"]  # fmt: skip
    lines = [
        '"Kernel Name","k"',
        ",".join(f'"{h}"' for h in header),
        '"0x0","BAR.SYNC 0x1","30","24","6","24","0","0"',
        '"0x10","STS.64 [R9], R1","10","0","10","0","1,024","2,048"',
    ]
    path = tmp_path / "k.csv"
    path.write_text("\n".join(lines) + "\n")
    preamble, rows = tool.read(str(path))
    assert preamble == [["Kernel Name", "k"]] and len(rows) == 2
    text = " ".join(tool.report(rows, top=5).split())
    assert "40 warp samples barrier 60.0% wait 40.0%" in text
    assert "BAR.SYNC 0x1 barrier 24, wait 6" in text
    assert "bank conflicts): 1024 of 2048 STS.64 [R9], R1" in text


def test_bwd_schedule_sim_turn_reads():
    """tools/bwd_schedule_sim.py's turn reads on a hand-counted case (one key block of 128 keys,
    two 64-row query tiles, one head, one SM): each deterministic visit's read at the wait costs
    the latency; read ahead, a turn passed by the visit's start (none to wait for here) costs
    nothing; the fast mode reads no turn."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "bwd_schedule_sim", root / "tools" / "bwd_schedule_sim.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def makespan(det, latency, ahead):
        return tool.schedule(1, 128, 1, 1, False, det, "current", 1, latency, ahead)[0]

    assert makespan(True, 0.0, False) == pytest.approx(2.0)
    assert makespan(True, 0.25, False) == pytest.approx(2.5)
    assert makespan(True, 0.25, True) == pytest.approx(2.0)
    assert makespan(False, 0.25, False) == pytest.approx(2.0)
    # At the grid's scale the read ahead recovers part of what the reads cost.
    plain, ahead = (
        tool.schedule(4, 1024, 2, 4, True, True, "current", 16, 0.15, a)[0] for a in (False, True)
    )
    fast = tool.schedule(4, 1024, 2, 4, True, False, "current", 16)[0]
    assert fast < ahead < plain
