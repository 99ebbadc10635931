#!/usr/bin/env bash
# The main job on a built-in default: installs, builds, and generates an image with the built-in
# tiny pipeline of FLUX.1's architecture (random weights, made on the fly with a fixed seed), once
# on one rank and once with the transformer split over two ranks (TP=2), and checks that both
# give the same image (equal PNG pixels, up to one 8-bit level where float rounding differs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
BUILD_DIR=${SHARDIT_BUILD_DIR:-build}
SHARDIT="$BUILD_DIR/apps/shardit"
ARGS=(generate --height 256 --width 256 --steps 4 --seed 42)
"$SHARDIT" "${ARGS[@]}" --out "$BUILD_DIR/builtin-tp1.png"
"$SHARDIT" --nproc-per-node 2 "${ARGS[@]}" --out "$BUILD_DIR/builtin-tp2.png" --compare-to "$BUILD_DIR/builtin-tp1.png"
echo "OK: TP=2 wrote $BUILD_DIR/builtin-tp2.png, equal to the TP=1 image $BUILD_DIR/builtin-tp1.png."
echo "The built-in pipeline's weights are random, so the picture is noise: it shows that the whole"
echo "pipeline (scheduler, sharded transformer, VAE, PNG) runs. For a real image, see README.md."
