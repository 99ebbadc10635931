#!/usr/bin/env bash
# Configures and builds shardit into ./build (Release, Ninja, ccache). Extra args go to CMake.
#   SHARDIT_BUILD_DIR      the build folder (default build)
#   SHARDIT_JOBS           parallel compile jobs (default: the number of cores)
#   SHARDIT_BUILD_TARGETS  the targets to build, space-separated (default: all of them, as the
#                          test command needs; the quick start builds only shardit_cli)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SHARDIT_BUILD_DIR:-build}
JOBS=${SHARDIT_JOBS:-$(nproc)}
read -r -a TARGETS <<<"${SHARDIT_BUILD_TARGETS:-}"
# Linking LibTorch programs takes ~1 GiB each; keep parallel jobs within memory.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
if [ ${#TARGETS[@]} -eq 0 ]; then
  cmake --build "$BUILD_DIR" -j "$JOBS"
else
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}"
fi
