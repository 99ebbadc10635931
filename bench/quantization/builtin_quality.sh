#!/usr/bin/env bash
# Image quality of the built-in model (trained to draw: tools/train_builtin_model.py) under the
# engine's approximations: the drawing test's prompts (tests/dist/test_builtin_drawing.cpp) at
# 128x128, 8 steps, in fp32, with step caching (First-Block Cache 0.3: 4 of the 8 transformer
# calls skipped), in bf16, and with the transformer's Linears in int8 and FP8 (--weights-dtype);
# PSNR and SSIM of each image against the fp32 one (bench/quantization/psnr.py).
# Usage: bash bench/quantization/builtin_quality.sh [out_dir]   (after building shardit_cli)
set -euo pipefail
cd "$(dirname "$0")/../.."
cli=${SHARDIT_CLI:-build/apps/shardit}
out=${1:-${TMPDIR:-/tmp}/shardit-builtin-quality}
mkdir -p "$out"
prompts=(--prompt "a large yellow circle at the bottom right"
         --prompt "a large white square at the bottom on a green background"
         --prompt "a large red triangle at the top left"
         --prompt "a large yellow triangle at the bottom right")
variants=("fp32|" "cache|--cache first_block_cache:threshold=0.3" "bf16|--dtype bf16" "int8|--weights-dtype int8"
          "fp8|--weights-dtype fp8")
files=()
for variant in "${variants[@]}"; do
  name=${variant%%|*}
  read -r -a options <<<"${variant#*|}"
  "$cli" generate "${prompts[@]}" --max-sequence-length 32 --height 128 --width 128 --steps 8 --seed 42 \
    "${options[@]}" --out "$out/$name.png" --out-tensors "$out/$name.safetensors" >"$out/$name.log" 2>&1
  files+=("$out/$name.safetensors")
done
python3 bench/quantization/psnr.py "${files[@]}"
