#!/usr/bin/env bash
# Compiles the CUDA kernels of a source tree on this machine (no GPU needed) into a gzipped static
# archive with its stamp, so that a lent GPU machine links them instead of compiling them
# (cuda/src/kernels.cmake): its build then compiles only the handlers and the module. Needs the
# CUDA compiler and a Python with jax and nanobind (the first `python` on PATH, or $PYTHON).
#
#   tools/gpu/prebuilt_kernels.sh SRC OUT_DIR [ARCHS]      # ARCHS: default 90a
#     -> OUT_DIR/libjax_flash_kernels.a.gz, OUT_DIR/libjax_flash_kernels.a.sources
#
# On the GPU machine, with OUT_DIR carried along (e.g. under the ignored scratch/) and SRC's tree
# checked out (the stamp must match it):
#   gunzip -kf OUT_DIR/libjax_flash_kernels.a.gz
#   CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a -DJAX_FLASH_KERNELS_ARCHIVE=$PWD/OUT_DIR/libjax_flash_kernels.a" \
#     python3 -m pip install --no-build-isolation --no-deps -e .
set -euo pipefail
src=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
archs=${3:-90a}
python=${PYTHON:-$(command -v python)}
build="$out/build"
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_FLASH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" -DPython_EXECUTABLE="$python" > "$out/configure.log"
cmake --build "$build" --target jax_flash_kernels -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
gzip -c "$build/libjax_flash_kernels.a" > "$out/libjax_flash_kernels.a.gz"
cp "$build/libjax_flash_kernels.a.sources" "$out/"
ls -l "$out/libjax_flash_kernels.a.gz"
