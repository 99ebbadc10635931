#!/usr/bin/env bash
# The main job on a built-in default: installs, builds, and generates an image from a prompt with
# the built-in tiny pipeline of FLUX.1's architecture (tokenizers and CLIP + T5 text encoders
# included; its transformer and VAE trained to draw simple scenes, docs/builtin_model.md), once on
# one rank and once with the transformer and the text encoders split over two ranks (TP=2), and
# checks that both give the same image (equal PNG pixels, up to one 8-bit level where float
# rounding differs). The T5 prompt is cut to 32 tokens (FLUX.1's default is 512), as in training.
# It installs and builds only what the CLI needs (its libraries, not the tests, the fuzzer or the
# benchmarks); `bash scripts/test.sh` installs and builds the rest into the same build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh  # BUILD_DIR (SHARDIT_LIBTORCH=pip: build-pip)
bash scripts/setup.sh --cli
SHARDIT_BUILD_TARGETS=shardit_cli bash scripts/build.sh
SHARDIT="$BUILD_DIR/apps/shardit"
PROMPT="a large white square at the bottom on a green background"
ARGS=(generate --prompt "$PROMPT" --max-sequence-length 32 --height 128 --width 128 --steps 8 --seed 42)
"$SHARDIT" "${ARGS[@]}" --out "$BUILD_DIR/builtin-tp1.png"
"$SHARDIT" --nproc-per-node 2 "${ARGS[@]}" --out "$BUILD_DIR/builtin-tp2.png" --compare-to "$BUILD_DIR/builtin-tp1.png"
echo "OK: TP=2 wrote $BUILD_DIR/builtin-tp2.png, equal to the TP=1 image $BUILD_DIR/builtin-tp1.png."
echo "The picture is \"$PROMPT\", drawn by the built-in model, trained on simple scenes: shapes"
echo "(circle, square, triangle, star), colours (red, green, blue, yellow, orange, purple, white, black),"
echo "sizes (small, large), positions (at the top left ... in the center ... at the bottom right) and"
echo "backgrounds (on a blue background). Triangles and squares come out best, circles about half the"
echo "time, stars as blobs; two colours in one prompt are sometimes swapped (docs/builtin_model.md). E.g."
echo "  $SHARDIT generate --prompt \"a large red triangle at the top left\" --max-sequence-length 32 --height 128 --width 128 --steps 8 --seed 42 --out triangle.png"
echo "For real models, see README.md."
