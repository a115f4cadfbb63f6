"""Loads the native modules and registers their XLA FFI targets (once, at import).

`_cpu` is always built. `_cuda` exists when the package was built with a CUDA compiler; it links
the CUDA runtime statically, so importing it needs no GPU. Registration only records handlers;
nothing touches a GPU until a CUDA computation runs.
"""

from __future__ import annotations

from ._compat import ffi

try:
    from . import _cpu
except ImportError as e:  # pragma: no cover - a broken install
    raise ImportError(
        "jax_flash's native CPU module is missing; reinstall with "
        "`pip install --no-build-isolation .` (see README)"
    ) from e

try:
    from . import _cuda
except ImportError:
    _cuda = None

for _name, _capsule in _cpu.registrations().items():
    ffi.register_ffi_target(_name, _capsule, platform="cpu")

if _cuda is not None:
    for _name, _capsule in _cuda.registrations().items():
        ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def has_cuda_kernels() -> bool:
    """Whether this build of jax_flash contains the CUDA kernels."""
    return _cuda is not None
