#!/usr/bin/env bash
# The main job on a built-in default: installs, builds, and runs shardit on its built-in tiny
# model (inspect, then one tensor-parallel forward at TP=2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
BUILD_DIR=${SHARDIT_BUILD_DIR:-build}
"$BUILD_DIR/apps/shardit" inspect --plan --tp 2
"$BUILD_DIR/apps/shardit" --nproc-per-node 2 run-transformer --out "$BUILD_DIR/builtin-sample.safetensors"
