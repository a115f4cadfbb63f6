"""Helpers of the tests: random inputs and the dtype-aware tolerance."""

import re

import jax.numpy as jnp
import numpy as np

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}

# RoPE frequency scalings of the rope tests (Llama 3 style, and linear)
LLAMA3 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LINEAR = {"type": "linear", "factor": 4.0}


def randn(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "output holds NaN/inf"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def tolerance(dtype, same_dtype_err):
    """2x the error a plain jnp attention computed in the same dtype makes, plus a floor of one
    rounding unit of the dtype (1e-5 for float32, whose same-dtype error is ~0 here)."""
    return 2.0 * same_dtype_err + max(float(jnp.finfo(dtype).eps), 1e-5)


def run_on_host_devices(test_file: str, n: int, keyword: str) -> None:
    """Runs the tests of `test_file` selected by `keyword` in a child pytest with `n` CPU host
    devices; asserts they all ran and passed (none skipped)."""
    import os
    import subprocess
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test_file]
    cmd += ["-k", keyword]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, out[-8000:]


_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([\d,]*)\]")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s+([a-z][\w-]*)\(", re.M)


def collective_operands(hlo_text: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array each `op` instruction (or its async `-start`) of a compiled
    program's text sends, one entry per array operand. Read from the operands' definitions
    rather than the instruction's result type, which compilers print in different forms: GPU
    programs combine several arrays into one tuple-typed collective and run them
    asynchronously (start/done pairs whose result tuples hold operands, results and contexts)."""
    types = {m[1]: m[2] for m in _DEFINITION.finditer(hlo_text)}
    found = []
    for m in _DEFINITION.finditer(hlo_text):
        if m[3] not in (op, op + "-start"):
            continue
        depth, i = 1, m.end()
        while depth and i < len(hlo_text):
            depth += {"(": 1, ")": -1}.get(hlo_text[i], 0)
            i += 1
        operands = hlo_text[m.end() : i - 1]
        if "[" not in operands:  # bare names: their definitions' types
            names = (x.strip().lstrip("%") for x in operands.split(","))
            operands = " ".join(types.get(x, "") for x in names)
        found += [
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _SHAPE.findall(operands)
        ]
    return found
