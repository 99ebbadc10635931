#!/usr/bin/env bash
# The main job on a built-in default: installs, builds, and generates an image from a prompt with
# the built-in tiny pipeline of FLUX.1's architecture (random weights, tokenizers and CLIP + T5 text
# encoders included, made on the fly with a fixed seed), once on one rank and once with the
# transformer and the text encoders split over two ranks (TP=2), and checks that both give the
# same image (equal PNG pixels, up to one 8-bit level where float rounding differs). The T5 prompt
# is cut to 64 tokens (FLUX.1's default is 512) to keep the run short.
# It installs and builds only what the CLI needs (its libraries, not the tests, the fuzzer or the
# benchmarks); `bash scripts/test.sh` installs and builds the rest into the same build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh  # BUILD_DIR (SHARDIT_LIBTORCH=pip: build-pip)
bash scripts/setup.sh --cli
SHARDIT_BUILD_TARGETS=shardit_cli bash scripts/build.sh
SHARDIT="$BUILD_DIR/apps/shardit"
ARGS=(generate --prompt "a red fox in the snow" --max-sequence-length 64 --height 256 --width 256 --steps 4 --seed 42)
"$SHARDIT" "${ARGS[@]}" --out "$BUILD_DIR/builtin-tp1.png"
"$SHARDIT" --nproc-per-node 2 "${ARGS[@]}" --out "$BUILD_DIR/builtin-tp2.png" --compare-to "$BUILD_DIR/builtin-tp1.png"
echo "OK: TP=2 wrote $BUILD_DIR/builtin-tp2.png, equal to the TP=1 image $BUILD_DIR/builtin-tp1.png."
echo "The built-in pipeline's weights are random, so the picture is noise: it shows that the whole"
echo "pipeline (tokenizers, text encoders, scheduler, sharded transformer, VAE, PNG) runs. For a real"
echo "image, see README.md."
