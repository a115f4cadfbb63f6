"""The build says at configure time what it compiles and how to get the other choice.

Compiling the CUDA kernels takes minutes on a small machine, the CPU module well under one: the
default (JAX_FLASH_CUDA=AUTO) builds the CUDA kernels only where a GPU driver is, and every
outcome names the switch that gives the other one.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (message of an AUTO configure, the switch it must name)
OUTCOMES = (
    ("compiling the CUDA kernels", "JAX_FLASH_CUDA=OFF"),
    ("a CUDA compiler but no NVIDIA driver found", "JAX_FLASH_CUDA=ON"),
    ("no CUDA compiler found", None),
)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH")
def test_auto_configure_says_what_it_builds(tmp_path):
    env = dict(os.environ)
    env.pop("JAX_FLASH_CUDA", None)
    proc = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path), "-DJAX_FLASH_CUDA=AUTO",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "jax_flash:" in line]
    found = [(msg, switch) for msg, switch in OUTCOMES if any(msg in line for line in lines)]
    assert len(found) == 1, lines
    msg, switch = found[0]
    if switch is not None:
        assert any(switch in line for line in lines if msg in line), lines
