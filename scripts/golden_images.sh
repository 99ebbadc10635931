#!/usr/bin/env bash
# Generates the golden pipelines' images with the built CLI and prints one SHA-256 per run, for
# showing that a change leaves every output bit-identical: run it before and after, then diff the
# two listings. Five pipelines (FLUX.1, FLUX.1 Kontext edit, FLUX.2 [klein] edit, FLUX.2 [dev],
# Qwen-Image) at TP 1 and 2, in f32 and bf16, each from its case's prompt(s) and stored latents.
#   usage: bash scripts/golden_images.sh OUT_DIR     (writes OUT_DIR/<run>.png and .safetensors)
#   SHARDIT_BUILD_DIR  the build folder (default build)
#   SHARDIT_CLI        the shardit program to run (default: the build's), e.g. an earlier build's copy
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:?usage: golden_images.sh OUT_DIR}" && cd "$1" && pwd)
BUILD=$(cd "${SHARDIT_BUILD_DIR:-build}" && pwd)
CLI=${SHARDIT_CLI:-$BUILD/apps/shardit}
# The build's view of tests/golden (its packed files unpacked). The paths below are relative to it,
# so that the PNGs' text chunks, which name the latents file, do not depend on the build folder.
cd "$BUILD/tests/golden"
G=.
KLEIN_PROMPT=$'Poster with the text "FLUX & Qwen" in bold, 2 lines:\nline one\nline two \U0001F600'
CAT="A cat holding a sign that says hello world"

run() {  # run NAME ARGS...: one generate call at every degree and dtype
  local name=$1
  shift
  for tp in 1 2; do
    for dtype in f32 bf16; do
      local tag="${name}.tp${tp}.${dtype}"
      "$CLI" --nproc-per-node "$tp" generate --dtype "$dtype" --height 48 --width 64 --steps 3 \
        --out "$OUT/$tag.png" --out-tensors "$OUT/$tag.safetensors" "$@" >"$OUT/$tag.log" 2>&1 ||
        { echo "$tag failed:"; cat "$OUT/$tag.log"; exit 1; }
    done
  done
}

run flux1 --model $G/pipeline_flux1 --prompt "$CAT" --guidance 3.5 --latents $G/pipeline_flux1/inputs.safetensors
run flux1_kontext --model $G/pipeline_flux1 --pipeline FluxKontextPipeline --prompt "$CAT" --guidance 3.5 \
  --latents $G/pipeline_flux1/inputs.safetensors --image $G/edit_flux1_kontext/reference_a.png \
  --max-area 3072 --no-auto-resize
run flux2_klein_edit --model $G/pipeline_flux2_klein --prompt "$KLEIN_PROMPT" --guidance 4 \
  --latents $G/pipeline_flux2_klein/inputs.safetensors \
  --image $G/edit_flux2_klein/reference_a.png --image $G/edit_flux2_klein/reference_b.png
run flux2_dev --model $G/pipeline_flux2_dev --prompt "$CAT" --guidance 4 \
  --latents $G/pipeline_flux2_dev/inputs.safetensors
run qwenimage --model $G/pipeline_qwenimage \
  --prompt $'\u4e00\u4e2a\u5973\u5b69\u5728\u96e8\u4e2d\u6491\u4f1e\uff0c\u8857\u9053\u4e0a\u6709\u970f\u8679\u706f\u7684\u5012\u5f71' \
  --prompt "$CAT" --negative-prompt " " --negative-prompt "blurry, low quality" --true-cfg-scale 4 \
  --latents $G/pipeline_qwenimage/inputs.safetensors
(cd "$OUT" && sha256sum ./*.png ./*.safetensors)
