"""Run a module or script against another build of jax_flash in the same environment: the
build installed to DIR (`pip install --no-build-isolation --no-deps --target DIR <source>`), in
place of the editable install, for A/B timings of two builds on one card in alternating
processes.

    python tools/gpu/use_build.py /tmp/base -m jax_flash.bench backward --grid quick
    python tools/gpu/use_build.py /tmp/base tools/gpu/head_dim_bench.py OUT_DIR

PYTHONPATH alone does not do this: an editable install of scikit-build-core puts its import
finder at the front of `sys.meta_path`, ahead of every `sys.path` entry, so the editable build
is imported whatever PYTHONPATH says. This drops that finder, puts DIR first on `sys.path`,
prints the path of the jax_flash it imports (to stderr) and runs the rest of the command line
as `python -m MODULE ...` or `python SCRIPT ...` would.
"""

from __future__ import annotations

import os
import runpy
import sys


def use_build(build_dir: str) -> str:
    """Makes `import jax_flash` load the build in build_dir; returns the file it loaded."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"
    ]
    sys.path.insert(0, os.path.abspath(build_dir))
    import jax_flash  # first imported here: the editable install's .pth loads only its finder

    return jax_flash.__file__


def main(argv: list[str]) -> None:
    if len(argv) < 2 or (argv[1] == "-m" and len(argv) < 3):
        sys.exit(__doc__)
    loaded = use_build(argv[0])
    print(f"use_build: jax_flash from {loaded}", file=sys.stderr, flush=True)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
