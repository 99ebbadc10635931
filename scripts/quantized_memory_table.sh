#!/usr/bin/env bash
# Prints the 8-bit table of docs/quantization.md ("Memory per rank"): the transformer's weights per
# rank (full plan) of the released models in bf16, and with --weights-dtype fp8 / int8, plus the
# verdict for a 24 GiB host with one 1024x1024 step's activations (512 text tokens, math attention),
# from the real configs in tests/fixtures/configs (config.json only, nothing allocated):
#   bash scripts/quantized_memory_table.sh [path/to/shardit]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cli="${1:-$root/build/apps/shardit}"
echo "| model | TP | weights | weights per rank | + one step's activations | 24 GiB per rank | TP ranks on one 24 GiB host |"
echo "|---|---|---|---|---|---|---|"
for model in flux1_dev flux2_dev qwen_image; do
  for tp in 1 2 4; do
    for weights in checkpoint fp8 int8; do
      "$cli" inspect --plan --json --tp "$tp" --dtype bf16 --weights-dtype "$weights" --height 1024 --width 1024 \
        --device-memory 24 "$root/tests/fixtures/configs/$model" |
        python3 -c '
import json, sys
model, tp, weights = sys.argv[1], int(sys.argv[2]), sys.argv[3]
summary = json.load(sys.stdin)
weights_bytes = summary["pipeline"]["full"]["per_rank_bytes"]
verdict = next(v for v in summary["verdicts"] if v["tp_degree"] == tp and v["plan"] == "full")
label = "bf16" if weights == "checkpoint" else weights + " (rest bf16)"
gib = lambda b: "%.2f GiB" % (b / 2**30)
needed = verdict["per_rank_bytes"]
host = tp * needed
print("| %s | %d | %s | %s | %s | %s | %s (%s) |" % (model, tp, label, gib(weights_bytes), gib(needed),
      "fits" if verdict["fits"] else "does not fit", "fits" if host <= 24 * 2**30 else "does not fit", gib(host)))
' "$model" "$tp" "$weights"
    done
  done
done
