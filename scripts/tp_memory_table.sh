#!/usr/bin/env bash
# Prints the per-rank parameter table of docs/tensor-parallel.md ("Memory per rank") from the real
# transformer configs in tests/fixtures/configs (config.json only, nothing allocated):
#   bash scripts/tp_memory_table.sh [path/to/shardit]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cli="${1:-$root/build/apps/shardit}"
echo "| model | plan | TP | parameters | replicated | sharded | per rank | per rank bytes (bf16) |"
echo "|---|---|---|---|---|---|---|---|"
for model in flux1_dev flux2_dev flux2_klein_4b qwen_image; do
  for plan in full reference; do
    for tp in 1 2 4 8; do
      # The summary's rows: | component | class | plan | TP | parameters | replicated | sharded | per rank | bytes |
      "$cli" inspect --plan --tp "$tp" --dtype bf16 "$root/tests/fixtures/configs/$model" |
        awk -F' [|] ' -v model="$model" -v plan="$plan" '
          /^\| / && $3 == plan { sub(/ \|$/, "", $9); printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", model, $3, $4, $5, $6, $7, $8, $9 }'
    done
  done
done
