#!/usr/bin/env bash
# Configures and builds shardit (Release, Ninja, ccache). Extra args go to CMake.
#   SHARDIT_LIBTORCH       debian (default) or pip: the LibTorch to build against and the default
#                          build folder, ./build or ./build-pip (scripts/libtorch.sh). pip needs
#                          `SHARDIT_LIBTORCH=pip bash scripts/setup.sh` first (scripts/test.sh runs
#                          it) and builds with CUDA and NCCL (configure fails without them).
#   SHARDIT_BUILD_DIR      the build folder
#   SHARDIT_JOBS           parallel compile jobs (default: the number of cores)
#   SHARDIT_BUILD_TARGETS  the targets to build, space-separated (default: all of them, as the
#                          test command needs; the quick start builds only shardit_cli)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh
JOBS=${SHARDIT_JOBS:-$(nproc)}
read -r -a TARGETS <<<"${SHARDIT_BUILD_TARGETS:-}"
LIBTORCH_ARGS=()
if [ "$SHARDIT_LIBTORCH" = pip ]; then
  if [ ! -x "$TORCH_VENV/bin/python" ]; then
    echo "build: $TORCH_VENV has no Python: run SHARDIT_LIBTORCH=pip bash scripts/setup.sh first" >&2
    exit 1
  fi
  # The CUDA toolkit where NVIDIA's installer puts it, when nvcc is not on PATH.
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  mapfile -t LIBTORCH_ARGS < <(pip_libtorch_cmake_args "$(pip_libtorch_dir)")
fi
# Linking LibTorch programs takes ~1 GiB each; keep parallel jobs within memory.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${LIBTORCH_ARGS[@]}" "$@"
if [ ${#TARGETS[@]} -eq 0 ]; then
  cmake --build "$BUILD_DIR" -j "$JOBS"
else
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"
fi
