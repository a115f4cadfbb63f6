"""Test platforms: the CPU kernel always; the CUDA kernel when a GPU is present.

Every kernel test takes the `platform` fixture, so the same `pytest` command runs the GPU tests
where a GPU is, and reports them as skipped (with the reason) where not.
"""

import os

# XLA's GEMM autotuning buys the tests nothing (they time nothing) and was most of their compile
# time on a GPU: on one H100 the first backward test compiled its float32 reference gradient in
# 48.6 s with it, 7.8 s without. Set before JAX creates its backends (XLA_FLAGS is read then).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()

# Without an NVIDIA driver (CI: CPU only) most of the tests' time is XLA compiling small CPU
# programs (references, jitted calls); LLVM at -O0 compiles them faster: the CPU tests took
# 19-33% less time on two cores (test_flash_attention + test_paged 408 -> 329 s, test_train
# 67 -> 45 s) and their results are the same (no fast-math either way; test_flash_attention's
# jit-against-op-by-op check is bit for bit). jax_flash's own CPU kernels are C++ built at -O3.
# GPU machines keep XLA's default. Child processes of the multi-device tests inherit it.
if not os.path.exists("/proc/driver/nvidia/version"):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Nor does the test process need XLA's default preallocation of 75% of every GPU's memory, which
# left a test's subprocess (the sharded generation example on 4 H100s) out of memory for NCCL.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_flash  # noqa: E402

# Float32 results are compared at float32 tolerances: XLA's own matmuls (model projections,
# same-dtype baselines) must not drop to TF32 on GPUs. Set before anything is compiled.
jax.config.update("jax_default_matmul_precision", "highest")


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _cuda_skip_reason():
    if not jax_flash.has_cuda_kernels():
        return "jax_flash was built without CUDA kernels"
    if not _gpu_devices():
        return "no GPU visible to JAX"
    return None


CUDA_SKIP = _cuda_skip_reason()


def pytest_xdist_auto_num_workers(config):
    """`-n auto` where a GPU is visible: one worker per two cores (tools/parallel_tests.py's
    default, which the 16-core GPU machines have run many times), not one per core: each worker
    holds its own CUDA context and its compiles' host memory. Elsewhere xdist's default."""
    del config
    return max(1, (os.cpu_count() or 2) // 2) if CUDA_SKIP is None else None


def pytest_configure(config):
    """Under xdist (`-n`), workers that run out of tests take pending ones from busy workers
    ("worksteal") instead of each working through the fixed share "load" handed it: the suite's
    end is then not one worker finishing a long queue while the other idles."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "load":
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    """The multi-device child runs (each re-runs its file in a subprocess on several host
    devices: 15-65 s apiece on CI's two cores) first, so that they never come last."""
    del config
    items.sort(key=lambda item: "host_devices" not in item.name)


_ON_GPU = pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP))
PLATFORMS = ["cpu", pytest.param("cuda", marks=_ON_GPU)]
# The paged decode attention has two CUDA kernels; tests of it run each one (PagedLaunch).
PAGED_KERNELS = ("cuda_core", "tensor_core")
KERNEL_PLATFORMS = ["cpu"] + [pytest.param(f"cuda:{k}", marks=_ON_GPU) for k in PAGED_KERNELS]


class Platform:
    """Where a test runs: the device to place inputs on and the implementation to ask for;
    `kernel`: the paged decode kernel asked for (None: the default choice)."""

    def __init__(self, name, kernel=None):
        self.name = name
        self.kernel = kernel
        self.device = jax.devices("cpu")[0] if name == "cpu" else _gpu_devices()[0]

    def put(self, *xs):
        out = tuple(jax.device_put(x, self.device) for x in xs)
        return out if len(out) > 1 else out[0]

    def __repr__(self):
        return self.name if self.kernel is None else f"{self.name}:{self.kernel}"


@pytest.fixture(params=PLATFORMS)
def platform(request):
    return Platform(request.param)


@pytest.fixture(params=KERNEL_PLATFORMS)
def kernel_platform(request):
    """As `platform`, with the CUDA platform once per paged decode kernel."""
    name, _, kernel = request.param.partition(":")
    return Platform(name, kernel or None)


@pytest.fixture
def rng():
    """A fresh random generator per test; its seed is printed (shown by pytest on failure)."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
