"""Loads the native modules and registers their XLA FFI targets (once, at import).

`_cpu` is always built. `_cuda` exists when the package was built with a CUDA compiler; it links
the CUDA runtime statically, so importing it needs no GPU. Registration only records handlers;
nothing touches a GPU until a CUDA computation runs.

A source checkout that was installed without `-e` (`pip install .`) has its native modules in
the installed copy only; Python run from the checkout's root imports the source folder first
(the current directory leads `sys.path`). Then the installed copy's native modules are used: the
first other `jax_flash` folder on `sys.path` that holds a `_cpu` extension joins this package's
search path. They were built from the checkout as it was at install time; `pip install -e .`
builds them for the checkout itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import pathlib
import sys

from ._compat import ffi

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def find_installed_native(package_dir: pathlib.Path, paths) -> pathlib.Path | None:
    """The first `jax_flash` folder under `paths` (sys.path entries), other than `package_dir`,
    that holds the `_cpu` extension module; None if there is none."""
    for entry in paths:
        try:
            folder = (pathlib.Path(entry or ".") / "jax_flash").resolve()
        except (OSError, RuntimeError):
            continue
        if folder != package_dir and any(
            (folder / f"_cpu{suffix}").is_file()
            for suffix in importlib.machinery.EXTENSION_SUFFIXES
        ):
            return folder
    return None


def _import_cpu():
    name = f"{__package__}._cpu"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        installed = find_installed_native(_PACKAGE_DIR, sys.path)
        if installed is None:
            raise ImportError(
                f"jax_flash's native CPU module (_cpu) is not in {_PACKAGE_DIR}, and no installed "
                "jax_flash on sys.path has it: this looks like an unbuilt source checkout. Build "
                "it in place with `pip install --no-build-isolation -e .` from the checkout's "
                "root (see README), or run from outside the checkout to use an installed copy."
            ) from None
    except ImportError as e:
        raise ImportError(
            f"jax_flash's native CPU module failed to load ({e}); it was probably built against "
            "another Python or jaxlib: reinstall with `pip install --no-build-isolation .` "
            "(`-e .` in a source checkout)"
        ) from e
    sys.modules[__package__].__path__.append(str(installed))
    return importlib.import_module(name)


_cpu = _import_cpu()

try:
    from . import _cuda
except ImportError:
    _cuda = None

for _name, _capsule in _cpu.registrations().items():
    ffi.register_ffi_target(_name, _capsule, platform="cpu")

_CUDA_TARGETS = frozenset() if _cuda is None else frozenset(_cuda.registrations())
if _cuda is not None:
    for _name, _capsule in _cuda.registrations().items():
        ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def has_cuda_kernels() -> bool:
    """Whether this build of jax_flash contains the CUDA kernels."""
    return _cuda is not None


def has_cuda_target(name: str) -> bool:
    """Whether this build's CUDA module registers the FFI target `name`."""
    return _cuda is not None and name in _CUDA_TARGETS
