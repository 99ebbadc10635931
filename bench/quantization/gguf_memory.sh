#!/usr/bin/env bash
# Per-rank memory of a Q4_K GGUF FLUX.1 transformer against the same weights in bf16, tensor
# parallel: shardit-bench's synthetic FLUX.1-dev-width folder (3072 hidden, 24 heads x 128;
# --double/--single blocks, random bf16 weights) loaded at TP=N from the folder, then from a Q4_K
# GGUF file of it (Black Forest Labs' keys, as city96's files; tensors kept in F32/F16 by that
# tool's rules) written by tests/golden/tools/make_gguf_transformer_cases.py --folder. Each load
# prints its JSON record: per rank, peak RSS growth over the load, parameter bytes held and
# checkpoint bytes read; `expected_bytes_per_rank` is the plan's count (GGUF blocks as stored).
# Usage: bash bench/quantization/gguf_memory.sh [ranks] [double] [single]   (after building shardit-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
bench=${SHARDIT_BENCH:-build/bench/shardit-bench}
ranks=${1:-2}
double=${2:-1}
single=${3:-2}
cache=${TMPDIR:-/tmp}/shardit-bench
folder=$cache/flux1-width3072-d$double-s$single
gguf=$cache/flux1-width3072-d$double-s$single.q4_k.gguf
venv=${SHARDIT_GGUF_VENV:-build/tests/gguf-venv}

run_load() {  # label json [bench arguments...]
  local label=$1 json=$2
  shift 2
  "$bench" --nproc-per-node "$ranks" --double "$double" --single "$single" --cache-dir "$cache" --dtype bf16 \
    --label "$label" --json "$json" load --path shard-on-load "$@"
}

# The bf16 load writes the synthetic folder the first time.
run_load "bf16 folder" "$cache/load-bf16.json"
if [[ ! -f $gguf ]]; then
  python3 tests/golden/tools/make_gguf_transformer_cases.py --venv "$venv" --folder "$folder/transformer" \
    --types Q4_K --out "$gguf"
fi
run_load "Q4_K GGUF" "$cache/load-q4_k.json" --transformer "$gguf"
python3 - "$cache/load-bf16.json" "$cache/load-q4_k.json" <<'EOF'
import json, sys
bf16, q4k = (json.load(open(path)) for path in sys.argv[1:])
for name, key in (("parameter bytes", "parameter_bytes"), ("peak RSS growth", "peak_rss_growth_bytes"),
                  ("checkpoint bytes read", "checkpoint_bytes_read")):
    for a, b in zip(bf16["per_rank"], q4k["per_rank"]):
        print("rank %d %s: bf16 %.3f GiB, Q4_K %.3f GiB, ratio %.3f"
              % (a["rank"], name, a[key] / 2**30, b[key] / 2**30, b[key] / a[key]))
print("plan per rank: bf16 %.3f GiB, Q4_K %.3f GiB, ratio %.3f"
      % (bf16["expected_bytes_per_rank"] / 2**30, q4k["expected_bytes_per_rank"] / 2**30,
         q4k["expected_bytes_per_rank"] / bf16["expected_bytes_per_rank"]))
EOF
