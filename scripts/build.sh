#!/usr/bin/env bash
# Configures and builds shardit into ./build (Release, Ninja, ccache). Extra args go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SHARDIT_BUILD_DIR:-build}
JOBS=${SHARDIT_JOBS:-$(nproc)}
# Linking LibTorch programs takes ~1 GiB each; keep parallel jobs within memory.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
