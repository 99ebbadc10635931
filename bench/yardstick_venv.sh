#!/usr/bin/env bash
# Makes the Python that runs today's yardstick (bench/diffusers_flux_step.py, bench/compare's
# default): a venv with PyPI's torch and diffusers at the pinned versions below, what a user would
# run instead of shardit. Idempotent.
#   bash bench/yardstick_venv.sh [DIR]      (default build/yardstick-venv); then
#   bench/compare --python DIR/bin/python ...
# Needs python3-venv (Debian) and PyPI; the torch wheel is the default (CUDA) build, which also
# runs on a CPU, and pip's cache keeps it between runs (it is the wheel SHARDIT_LIBTORCH=pip builds
# against, scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.15.0
DIFFUSERS_VERSION=0.42.1
DIR=${1:-build/yardstick-venv}
[ -x "$DIR/bin/python" ] || python3 -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" "diffusers==$DIFFUSERS_VERSION"
"$DIR/bin/python" -c 'import torch, diffusers; print(f"yardstick: diffusers {diffusers.__version__} on torch {torch.__version__}")'
