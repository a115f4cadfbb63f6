"""Regression tests of issue 20's edge cases: disable_jit, degenerate shapes, loose arguments,
masked non-finite values in the reference, the source tree run from its root, CI, the example."""

import functools
import importlib.machinery
import importlib.util
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference

from _util import randn

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# 1. Every public op under jax.disable_jit (the eager impl used to re-bind itself forever)


def _op_calls(rng):
    """(name, thunk) of one small call of every public op; each thunk returns arrays."""
    f32 = jnp.float32
    q, k, v = (randn(rng, (2, 7, 4, 16), f32) for _ in range(3))
    kv = randn(rng, (7, 2, 16), f32)
    cu = jnp.array([0, 3, 7], jnp.int32)
    kp, vp = randn(rng, (6, 4, 2, 16), f32), randn(rng, (6, 4, 2, 16), f32)
    k8 = jnp.zeros((6, 4, 2, 16), jnp.int8)
    ks = jnp.ones((2,), f32)
    bt = jnp.array([[0, 1], [2, 3]], jnp.int32)
    lens = jnp.array([5, 7], jnp.int32)
    new = randn(rng, (3, 2, 16), f32)
    slots = jnp.array([0, 9, -1], jnp.int32)
    pos = jnp.array([4, 5, 6], jnp.int32)
    logits = randn(rng, (2, 33), f32)
    key = jax.random.key(3)
    return [
        ("flash_attention", lambda: jax_flash.flash_attention(q, k, v, causal=True)),
        (
            "flash_attention lse",
            lambda: jax_flash.flash_attention(q, k[:, :, :2], v[:, :, :2], return_lse=True),
        ),
        ("flash_attention_varlen", lambda: jax_flash.flash_attention_varlen(kv, kv, kv, cu, cu)),
        ("paged_attention", lambda: jax_flash.paged_attention(q[:, 0], kp, vp, bt, lens)),
        (
            "paged_attention int8",
            lambda: jax_flash.paged_attention(q[:, :2], k8, k8, bt, lens, k_scale=ks, v_scale=ks),
        ),
        ("append_kv", lambda: jax_flash.append_kv(kp, vp, new, new, slots)),
        (
            "append_kv rope",
            lambda: jax_flash.append_kv(kp, vp, new, new, slots, positions=pos, rope={}, q=new),
        ),
        (
            "append_qkv",
            lambda: jax_flash.append_qkv(
                kp, vp, jnp.stack([new, new, new], axis=2), slots, pos, rope={}
            ),
        ),
        ("copy_pages", lambda: jax_flash.copy_pages(kp, vp, jnp.array([0]), jnp.array([5]))),
        (
            "reorder_beams",
            lambda: jax_flash.reorder_beams(bt, lens, jnp.array([1, 1]), jnp.array([4, 5]), kp, vp),
        ),
        ("slot_mapping", lambda: jax_flash.slot_mapping(bt, lens, 4)),
        ("apply_rope", lambda: jax_flash.apply_rope(q, jnp.arange(7))),
        ("sample", lambda: jax_flash.sample(logits, key, temperature=0.7, top_k=5)),
        ("top_k_top_p_filter", lambda: jax_flash.top_k_top_p_filter(logits, top_p=0.5)),
    ]


@pytest.mark.parametrize("index", range(len(_op_calls(np.random.default_rng(0)))))
def test_disable_jit(rng, index):
    name, call = _op_calls(rng)[index]
    expected = call()
    with jax.disable_jit():
        got = call()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_disable_jit_check_paged_inputs():
    from jax.experimental import checkify

    bt = jnp.array([[0, 9]], jnp.int32)
    check = checkify.checkify(functools.partial(jax_flash.check_paged_inputs, num_pages=4))
    with jax.disable_jit():
        err, _ = check(bt, jnp.array([6], jnp.int32), page_size=4)
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_tables\[0, 1\] = 9"):
        err.throw()


# ---------------------------------------------------------------------------------------------
# 4. Head dim 0: a clear error (it used to give zeros, or ZeroDivisionError by default)


@pytest.mark.parametrize("scale", [None, 0.5])
def test_head_dim_zero(scale):
    q = jnp.zeros((1, 3, 2, 0), jnp.float32)
    v = jnp.ones((1, 3, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"flash_attention: the head dim D .* got D = 0"):
        jax_flash.flash_attention(q, q, v, softmax_scale=scale)
    cu = jnp.array([0, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"flash_attention_varlen: the head dim D"):
        jax_flash.flash_attention_varlen(q[0], q[0], v[0], cu, cu, softmax_scale=scale)
    pages = jnp.zeros((2, 4, 2, 0), jnp.float32)
    bt, lens = jnp.array([[0, 1]], jnp.int32), jnp.array([3], jnp.int32)
    with pytest.raises(ValueError, match=r"paged_attention: the head dim D"):
        jax_flash.paged_attention(q[:, 0], pages, pages, bt, lens, softmax_scale=scale)


# ---------------------------------------------------------------------------------------------
# 5. slot_mapping's arguments


_BT = np.array([[3, 5], [4, 6]], np.int32)


@pytest.mark.parametrize(
    "block_tables, positions, page_size, valid, exc, match",
    [
        (_BT, [1, 2], 0, None, ValueError, r"slot_mapping: page_size must be >= 1, got 0"),
        (_BT, [1, 2], -4, None, ValueError, r"slot_mapping: page_size must be >= 1"),
        (_BT, [1, 2], 4.0, None, TypeError, r"slot_mapping: page_size must be an int"),
        (_BT, [1, 2], True, None, TypeError, r"slot_mapping: page_size must be an int"),
        (_BT, [1.5, 2.0], 4, None, TypeError, r"slot_mapping: positions must be an integer"),
        (_BT[0], [1, 2], 4, None, ValueError, r"slot_mapping: block_tables must have rank 2"),
        (_BT.astype(np.float32), [1, 2], 4, None, TypeError, r"block_tables must be an integer"),
        (_BT, [1, 2, 3], 4, None, ValueError, r"slot_mapping: positions must have shape \[B\]"),
        (_BT, [[1, 2, 3]], 4, None, ValueError, r"slot_mapping: positions must have shape"),
        (_BT, [1, 2], 4, [1, 0], ValueError, r"slot_mapping: valid must be a bool array"),
        (_BT, [1, 2], 4, [True], ValueError, r"slot_mapping: valid must be a bool array"),
        ([[3, 5]], [1], 4, None, TypeError, r"slot_mapping: block_tables must be an array"),
    ],
)
def test_slot_mapping_errors(block_tables, positions, page_size, valid, exc, match):
    if isinstance(block_tables, np.ndarray):
        block_tables = jnp.asarray(block_tables)
    with pytest.raises(exc, match=match):
        jax_flash.slot_mapping(block_tables, positions, page_size, valid)


def test_slot_mapping_values(rng):
    """Against a plain loop: odd sizes, positions past the table, negative, masked."""
    B, S, max_pages, page_size = 5, 7, 3, 5
    bt = rng.integers(0, 40, (B, max_pages)).astype(np.int32)
    pos = rng.integers(-3, max_pages * page_size + 4, (B, S)).astype(np.int32)
    valid = rng.random((B, S)) < 0.8
    expected = np.full((B, S), -1, np.int64)
    for b in range(B):
        for s in range(S):
            p = pos[b, s]
            if valid[b, s] and 0 <= p < max_pages * page_size:
                expected[b, s] = bt[b, p // page_size] * page_size + p % page_size
    got = jax_flash.slot_mapping(jnp.asarray(bt), jnp.asarray(pos), page_size, jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(got), expected)
    rows = jax_flash.slot_mapping(jnp.asarray(bt), pos[:, 0], page_size, valid[:, 0])
    np.testing.assert_array_equal(np.asarray(rows), expected[:, 0])
    per_row = jax_flash.slot_mapping(jnp.asarray(bt), pos, page_size, valid[:, 0])
    np.testing.assert_array_equal(np.asarray(per_row)[~valid[:, 0]], -1)


# ---------------------------------------------------------------------------------------------
# 6. reorder_beams' page_size must be the cache's


def test_reorder_beams_page_size(rng):
    kp = vp = randn(rng, (8, 4, 1, 16), jnp.float32)
    bt = jnp.array([[0, 1], [2, 3]], jnp.int32)
    lens = jnp.array([6, 6], jnp.int32)
    args = (bt, lens, jnp.array([0, 0]), jnp.array([6, 7], jnp.int32), kp, vp)
    with pytest.raises(ValueError, match=r"reorder_beams: page_size=8 does not match .* 4"):
        jax_flash.reorder_beams(*args, page_size=8)
    with pytest.raises(TypeError, match=r"reorder_beams: page_size must be an int"):
        jax_flash.reorder_beams(*args, page_size=4.0)
    same = jax_flash.reorder_beams(*args, page_size=4)
    default = jax_flash.reorder_beams(*args)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(default), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(default[0]).tolist() == [[0, 6], [0, 7]]
    with pytest.raises(ValueError, match=r"reorder_beams: block_tables must have rank 2"):
        jax_flash.reorder_beams(bt[0], *args[1:])


# ---------------------------------------------------------------------------------------------
# 7. The reference: keys a row cannot see contribute nothing, even NaN or inf ones


def _attention_f64(q, k, v, visible):
    """softmax(q k^T / sqrt(D)) v in float64 over the visible keys only: [Sq, Dv] per head."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for h in range(q.shape[1]):
        for i in range(q.shape[0]):
            js = np.flatnonzero(visible[i])
            s = k[js, h] @ q[i, h] / np.sqrt(q.shape[2])
            p = np.exp(s - s.max())
            out[i, h] = p @ v[js, h] / p.sum() if len(js) else 0.0
    return out


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reference_masked_nonfinite(rng, bad):
    Sq, Sk, H, D = 5, 9, 2, 8
    q, k = randn(rng, (Sq, H, D), jnp.float32), randn(rng, (Sk, H, D), jnp.float32)
    v = np.asarray(randn(rng, (Sk, H, D), jnp.float32)).copy()
    v[Sk - 1, 0, 3] = bad  # only the last query row sees the last key (causal, bottom-right)
    v[Sk - 2, 1, :] = bad  # the last two rows see this one
    visible = np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + Sk - Sq
    expected = _attention_f64(q, k, np.nan_to_num(v, nan=0, posinf=0, neginf=0), visible)
    expected[Sq - 1, 0, 3] = bad
    expected[Sq - 2 :, 1, :] = bad
    o = reference.attention(q[None], k[None], jnp.asarray(v)[None], causal=True)[0]
    np.testing.assert_allclose(np.asarray(o, np.float64), expected, rtol=1e-5, atol=1e-6)
    cu = jnp.array([0, Sq], jnp.int32), jnp.array([0, Sk], jnp.int32)
    o = reference.attention_varlen(q, k, jnp.asarray(v), *cu, causal=True)
    np.testing.assert_allclose(np.asarray(o, np.float64), expected, rtol=1e-5, atol=1e-6)


def test_reference_nonfinite_rules():
    """A visible inf with a zero weight (exp underflow), or +inf with -inf, gives NaN."""
    q = jnp.ones((1, 2, 1, 1), jnp.float32)
    k = jnp.array([0.0, -1e4, 0.0], jnp.float32).reshape(1, 3, 1, 1)
    v = jnp.array([1.0, np.inf, 2.0], jnp.float32).reshape(1, 3, 1, 1)
    o = np.asarray(reference.attention(q, k, v, softmax_scale=1.0, sliding_window=(0, 1)))
    assert np.isnan(o[0, 0, 0, 0]), "key 1 is seen with weight exp(-1e4) = 0: 0 * inf = NaN"
    v = jnp.array([np.inf, -np.inf, 2.0], jnp.float32).reshape(1, 3, 1, 1)
    k = jnp.zeros((1, 3, 1, 1), jnp.float32)
    o = np.asarray(reference.attention(q, k, v, sliding_window=(1, 0)))  # keys 0-1 / 1-2
    assert np.isnan(o[0, 0, 0, 0]) and o[0, 1, 0, 0] == -np.inf


# ---------------------------------------------------------------------------------------------
# 8. Loose arguments: causal must be a bool, window sides ints, errors name the function


def _dense(**kw):
    x = jnp.zeros((1, 3, 1, 8), jnp.float32)
    return jax_flash.flash_attention(x, x, x, **kw)


def _varlen(**kw):
    x, cu = jnp.zeros((3, 1, 8), jnp.float32), jnp.array([0, 3], jnp.int32)
    return jax_flash.flash_attention_varlen(x, x, x, cu, cu, **kw)


def _paged(**kw):
    pages = jnp.zeros((2, 4, 1, 8), jnp.float32)
    return jax_flash.paged_attention(
        jnp.zeros((1, 1, 8), jnp.float32), pages, pages, jnp.array([[0, 1]]), jnp.array([3]), **kw
    )


@pytest.mark.parametrize(
    "call, op", [(_dense, "flash_attention"), (_varlen, "flash_attention_varlen")]
)
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"causal": "no"}, TypeError, r"causal must be a bool, got 'no'"),
        ({"causal": 1}, TypeError, r"causal must be a bool"),
        ({"causal": None}, TypeError, r"causal must be a bool"),
        ({"sliding_window": (8.5, 0)}, TypeError, r"sliding_window left must be an int"),
        ({"sliding_window": (4, "2")}, TypeError, r"sliding_window right must be an int"),
        ({"sliding_window": (True, 0)}, TypeError, r"sliding_window left must be an int"),
        ({"sliding_window": 4}, ValueError, r"sliding_window must be None or a pair"),
        ({"sliding_window": (-2, 0)}, ValueError, r"sliding_window left must be >= 0"),
        ({"causal": True, "sliding_window": (4, 2)}, ValueError, r"causal=True allows no keys"),
    ],
)
def test_loose_arguments(call, op, kw, exc, match):
    with pytest.raises(exc, match=f"{op}: {match}"):
        call(**kw)


@pytest.mark.parametrize("kw", [{"causal": "no"}, {"sliding_window": (8.5, 0)}])
def test_loose_arguments_paged(kw):
    with pytest.raises(TypeError, match=r"causal must be a bool|sliding_window left must be"):
        _paged(**kw)


def test_strict_arguments_accept_numpy_types(rng):
    q, k, v = (randn(rng, (1, 9, 2, 8), jnp.float32) for _ in range(3))
    expected = jax_flash.flash_attention(q, k, v, causal=True, sliding_window=(3, None))
    got = jax_flash.flash_attention(
        q, k, v, causal=np.bool_(True), sliding_window=(np.int64(3), np.int32(-1))
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert reference.normalize_window(np.bool_(False), [np.int16(2), 0]) == (2, 0)


# ---------------------------------------------------------------------------------------------
# 9. Python run from a checkout's root imports the unbuilt source folder: it must find the
# installed copy's native modules (a non-editable install), or say what to do


def _extensions():
    folder = pathlib.Path(jax_flash._native._cpu.__file__).parent
    return [f for f in folder.iterdir() if f.name.startswith(("_cpu.", "_cuda."))]


def _unbuilt_checkout(tmp_path):
    """A copy of the package's Python files, as in a fresh clone (no native modules)."""
    src = tmp_path / "checkout"
    shutil.copytree(
        ROOT / "jax_flash",
        src / "jax_flash",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"),
    )
    return src


def _run_isolated(cwd, path, code):
    """`python -S -c code` in cwd with sys.path = [cwd] + path + this environment's packages,
    without the site hooks (an editable install's import redirection)."""
    paths = sysconfig.get_paths()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([*map(str, path), paths["purelib"], paths["platlib"]]),
    )
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_source_tree_uses_installed_native_modules(tmp_path):
    src = _unbuilt_checkout(tmp_path)
    site = tmp_path / "site"
    (site / "jax_flash").mkdir(parents=True)
    for f in _extensions():
        shutil.copy(f, site / "jax_flash" / f.name)
    code = (
        "import jax.numpy as jnp, jax_flash\n"
        "print(jax_flash.__file__)\n"
        "print(jax_flash._native._cpu.__file__)\n"
        "x = jnp.ones((1, 5, 2, 8), jnp.float32)\n"
        "print(float(jax_flash.flash_attention(x, x, x, causal=True).sum()))\n"
    )
    run = _run_isolated(src, [site], code)
    assert run.returncode == 0, run.stderr
    package, native, total = run.stdout.split()
    assert pathlib.Path(package).parent == (src / "jax_flash").resolve()
    assert pathlib.Path(native).parent == (site / "jax_flash").resolve()
    assert float(total) == 80.0


def test_find_installed_native(tmp_path):
    here = tmp_path / "checkout" / "jax_flash"
    here.mkdir(parents=True)
    (here / "_cpu.so").write_bytes(b"")  # the package's own folder never counts
    python_only = tmp_path / "a" / "jax_flash"
    python_only.mkdir(parents=True)
    (python_only / "__init__.py").write_text("")
    built = tmp_path / "b" / "jax_flash"
    built.mkdir(parents=True)
    ext = "_cpu" + importlib.machinery.EXTENSION_SUFFIXES[0]
    (built / ext).write_bytes(b"")
    paths = [
        str(tmp_path / "checkout"),
        str(tmp_path / "a"),
        str(tmp_path / "missing"),
        str(tmp_path / "b"),
    ]
    find = jax_flash._native.find_installed_native
    assert find(here.resolve(), paths) == built.resolve()
    assert find(here.resolve(), paths[:3]) is None


def test_unbuilt_source_tree_message(tmp_path):
    """With no native modules anywhere, the error names the cause and the fix."""
    src = _unbuilt_checkout(tmp_path)
    # Only the packages jax_flash imports, without any jax_flash folder holding the modules.
    deps = tmp_path / "deps"
    deps.mkdir()
    purelib = pathlib.Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        if entry.name != "jax_flash" and not entry.name.startswith("_editable"):
            (deps / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=str(deps), JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-S", "-c", "import jax_flash"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "unbuilt source checkout" in run.stderr
    assert "pip install --no-build-isolation -e ." in run.stderr


# ---------------------------------------------------------------------------------------------
# 11. CI installs torch and transformers from the default index, and fails if it cannot


def test_ci_installs_parity_dependencies():
    script = (ROOT / ".ci" / "run").read_text()
    assert "index-url" not in script and " -i " not in script, "CI names another package index"
    top_level = [line.strip() for line in script.splitlines() if not line.startswith((" ", "#"))]
    assert any(line.startswith("pip install -q torch==") for line in top_level)
    assert "pip install -q transformers" in top_level
    assert "set -euo pipefail" in top_level, "a failed install must fail CI"


# ---------------------------------------------------------------------------------------------
# 12. examples/generate.py: its arguments, and the progress bar's last line


@pytest.fixture(scope="module")
def generate_example():
    pytest.importorskip("flax.nnx")
    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples/generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--prompt", "hi"], r"--prompt needs --checkpoint"),
        (["--num-beams", "0"], r"--num-beams: must be >= 1, got 0"),
        (["--steps-per-call", "0"], r"--steps-per-call: must be >= 1, got 0"),
        (["--page-size", "-1"], r"--page-size: must be >= 1"),
        (["--max-new-tokens", "x"], r"--max-new-tokens: expected an integer"),
        (["--dtype", "int8"], r"--dtype: unknown dtype 'int8'"),
    ],
)
def test_generate_example_argument_errors(generate_example, capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        generate_example.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_generate_example_arguments(generate_example):
    for alias, name in [("bf16", "bfloat16"), ("FP16", "float16"), ("fp32", "float32")]:
        assert generate_example.parse_args(["--dtype", alias]).dtype == name
    args = generate_example.parse_args(["--checkpoint", "d", "--prompt", "a", "--prompt", "b"])
    assert args.prompt == ["a", "b"] and args.num_beams is None
    undocumented = [a.dest for a in generate_example.build_parser()._actions if not a.help]
    assert not undocumented, f"options without help text: {undocumented}"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_generate_example_progress_bar_ends_its_line(generate_example, tty):
    stream = _Terminal() if tty else io.StringIO()
    bar = generate_example.ProgressBar("demo", stream=stream)
    bar(8, 32)
    bar(16, 32)  # every sequence stopped early: no call with step == total
    bar.close()
    bar.close()
    print("next", file=stream)
    lines = stream.getvalue().replace("\r", "\n").split("\n")
    assert lines[-2] == "next" and lines[-3].endswith("16/32 steps")


def _sanitizer_driver(*flags):
    """tools/sanitize.py's driver (what each compute-sanitizer tool runs) on the CPU kernels:
    the op names of the calls it made."""
    cmd = [sys.executable, str(ROOT / "tools" / "sanitize.py"), "--driver"]
    out = subprocess.run([*cmd, "--driver-platform", "cpu", "--quick", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("driver: OK")
    return {line.split()[1] for line in lines[:-1] if line.startswith("driver: ")}


def test_sanitizer_driver_calls_every_op():
    # The GPU sanitizer run is only as good as its driver: it must keep calling every op.
    assert _sanitizer_driver() == {
        "flash_attention", "flash_attention_varlen", "paged_attention", "append_kv", "append_qkv",
        "copy_pages", "reorder_beams", "apply_rope", "sample", "top_k_top_p_filter",
    }  # fmt: skip
    assert _sanitizer_driver("--ops", "paged_attention,apply_rope") == {
        "paged_attention",
        "apply_rope",
    }
