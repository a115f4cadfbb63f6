"""The e4m3 -> float16 conversion of the 8-bit-cache paged kernels (`paged::e4m3x4_to_f16x2`,
cuda/include/jax_flash/paged/ptx.cuh) equals the CUDA library's bit for bit on all 2^16 pairs of
codes, NaN codes included: the card's own path (the conversion instruction from sm_89) and the
bit-moving path of cards without it (sm_80), the latter built as PTX for compute_80, which the
driver compiles for the card at hand. tools/gpu/e4m3_convert_check.cu is the check; this builds
and runs it where a GPU and nvcc are.
"""

import pathlib
import shutil
import subprocess

import pytest
from conftest import CUDA_SKIP

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = ROOT / "tools" / "gpu" / "e4m3_convert_check.cu"

pytestmark = [
    pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP)),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH"),
]


@pytest.mark.parametrize(
    "arch, path",
    [("native", "this card's"), ("compute_80,code=compute_80", "sm_80's (PTX, JIT-compiled)")],
    ids=["native", "sm80-ptx"],
)
def test_matches_the_library(tmp_path, arch, path):
    exe = tmp_path / "e4m3_check"
    gencode = ["-arch=native"] if arch == "native" else [f"-gencode=arch={arch}"]
    build = subprocess.run(
        ["nvcc", "-std=c++17", f"-I{ROOT / 'cuda' / 'include'}", *gencode, str(CHECK),
         "-o", str(exe)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and " 0 of 65536 pairs differ" in run.stdout, (
        f"{path} path: {run.stdout}{run.stderr}"
    )
