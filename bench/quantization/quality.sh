#!/usr/bin/env bash
# Image error of 8-bit transformer weights on the golden pipelines (tests/golden/pipeline_*, the
# diffusers cases' prompts, sizes, steps and latents): each pipeline in fp32, bf16, and with the
# transformer's Linears in fp8 / int8 (--weights-dtype), and int8 multiplied in int8
# (--int8-compute), PSNR of each image against the fp32 one.
# Usage: bash bench/quantization/quality.sh [out_dir]   (after building shardit_cli)
set -euo pipefail
cd "$(dirname "$0")/../.."
cli=${SHARDIT_CLI:-build/apps/shardit}
out=${1:-${TMPDIR:-/tmp}/shardit-quantization-quality}
mkdir -p "$out"
golden=build/tests/golden  # the build's view of tests/golden: its packed files unpacked
variants=("f32 checkpoint" "bf16 checkpoint" "f32 fp8" "f32 int8" "bf16 fp8" "bf16 int8" "f32 int8 int8-compute"
          "bf16 int8 int8-compute")

measure() {  # name folder generate-arguments...
  local name=$1 folder=$2
  shift 2
  local files=()
  for variant in "${variants[@]}"; do
    read -r dtype weights compute <<<"$variant"
    local tag="$name-$dtype-$weights${compute:+-$compute}"
    local file="$out/$tag.safetensors"
    local start=$(date +%s.%N)
    "$cli" generate --model "$folder" --latents "$folder/inputs.safetensors" --dtype "$dtype" \
      --weights-dtype "$weights" ${compute:+--$compute} --out-tensors "$file" --out "$out/$tag.png" "$@" \
      >"$out/$tag.log" 2>&1
    echo "$name $dtype $weights $compute: $(echo "$(date +%s.%N) - $start" | bc) s (whole generate)"
    files+=("$file")
  done
  python3 bench/quantization/psnr.py "${files[@]}"
}

measure flux1 "$golden/pipeline_flux1" --prompt "A cat holding a sign that says hello world" \
  --height 48 --width 64 --steps 3 --guidance 3.5
measure flux2_klein "$golden/pipeline_flux2_klein" \
  --prompt $'Poster with the text "FLUX & Qwen" in bold, 2 lines:\nline one\nline two \U0001F600' \
  --height 48 --width 64 --steps 3 --guidance 4.0
measure qwenimage "$golden/pipeline_qwenimage" \
  --prompt "一个女孩在雨中撑伞，街道上有霏虹灯的倒影" --prompt "A cat holding a sign that says hello world" \
  --negative-prompt " " --negative-prompt "blurry, low quality" --height 48 --width 64 --steps 3 --true-cfg-scale 4.0
