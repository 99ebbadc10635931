#!/usr/bin/env bash
# The GPU check, in one command, for a machine with an NVIDIA GPU, Python with PyPI's torch (its
# LibTorch is what shardit builds against), nvcc, CMake and ninja, and no network:
#   bash scripts/gpu_check.sh OUT_DIR
# It unpacks .gpu_bundle/bundle.tar.xz (scripts/gpu_bundle.sh: our Debian build dependencies and
# the diffusers wheel; without it the build uses the system's packages), configures and builds the
# CLI, the GPU tests and the bench against that torch into build-gpu/, then
#   1. `shardit version`;
#   2. the golden transformer cases on CUDA, fp32 and bf16, TP=1, at the CPU tests' tolerances
#      (tests/gpu/test_cuda_transformers.cpp); a case skipped on a GPU machine is a failure;
#   3. one FLUX.1-dev-width forward (19 + 38 blocks, random weights) at 1024x1024 (4096 + 512
#      tokens) in bf16: shardit-bench, then diffusers' FluxTransformer2DModel on the same GPU.
# It writes OUT_DIR/gpu_check.json (each step's status and numbers) and OUT_DIR/gpu_check.log.
# Where no CUDA device is visible (a rehearsal, docs/building.md "On a GPU") steps 2-3 run what the
# CPU can: the CUDA cases report skipped, the forward runs at 2 + 4 blocks and 256x256 on the CPU.
# Exit status: 0 when every step passed.
#   SHARDIT_PYTHON     the Python whose torch to build against (default python3)
#   SHARDIT_GPU_JOBS   compile jobs (default: the number of cores)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:?usage: gpu_check.sh OUT_DIR}" && cd "$1" && pwd)
exec > >(tee "$OUT/gpu_check.log") 2>&1
PYTHON=${SHARDIT_PYTHON:-python3}
BUILD=build-gpu
STEPS="$OUT/steps.jsonl"
: >"$STEPS"
start_all=$SECONDS

# One line per step in steps.jsonl: name, status, seconds, detail (a JSON value).
record() {
  "$PYTHON" -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "status": sys.argv[2], "seconds": int(sys.argv[3]), "detail": json.loads(sys.argv[4])}))' \
    "$1" "$2" "$3" "${4:-null}" >>"$STEPS"
  echo "gpu_check: step $1: $2 ($3 s)"
}
finish() {
  "$PYTHON" - "$STEPS" "$OUT/gpu_check.json" "$((SECONDS - start_all))" <<'PY'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
summary = {"passed": all(s["status"] in ("passed", "rehearsed") for s in steps), "seconds": int(sys.argv[3]),
           "steps": steps}
json.dump(summary, open(sys.argv[2], "w"), indent=2)
print("gpu_check:", "PASSED" if summary["passed"] else "FAILED", json.dumps({s["step"]: s["status"] for s in steps}))
PY
}
trap finish EXIT

# 0. The machine
t=$SECONDS
machine=$("$PYTHON" - <<'PY'
import json, os, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "torch_dir": os.path.dirname(torch.__file__),
                  "torch_cuda": torch.version.cuda, "cuda_devices": torch.cuda.device_count() if cuda else 0,
                  "gpu": torch.cuda.get_device_name(0) if cuda else None, "cores": os.cpu_count()}))
PY
) || { record machine failed $((SECONDS - t)) '"no torch in '"$PYTHON"'"'; exit 1; }
record machine passed $((SECONDS - t)) "$machine"
TORCH_DIR=$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["torch_dir"])' "$machine")
HAVE_GPU=$("$PYTHON" -c 'import json,sys; print(1 if json.loads(sys.argv[1])["cuda_devices"] else 0)' "$machine")
nvcc --version | tail -1 || true

# 1. The bundle: our build dependencies in a prefix, diffusers on PYTHONPATH
t=$SECONDS
cmake_extra=()
if [ -f .gpu_bundle/bundle.tar.xz ]; then
  rm -rf "$BUILD/bundle" && mkdir -p "$BUILD/bundle"
  "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .gpu_bundle/bundle.tar.xz "$BUILD/bundle" ||
    { record bundle failed $((SECONDS - t)) '"could not unpack .gpu_bundle/bundle.tar.xz"'; exit 1; }
  DEPS=$(cd "$BUILD/bundle/deps" && pwd)
  export PATH="$DEPS/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The prefix stands where /usr would on a Debian machine: headers found without -I (Gloo's, which
  # LibTorch's c10d headers include), libraries without -L.
  export CPATH="$DEPS/usr/include:$DEPS/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export PKG_CONFIG_SYSROOT_DIR="$DEPS"
  export PKG_CONFIG_LIBDIR="$DEPS/usr/lib/x86_64-linux-gnu/pkgconfig:$DEPS/usr/share/pkgconfig"
  export PYTHONPATH="$(cd "$BUILD/bundle/python" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  cmake_extra+=("-DCMAKE_PREFIX_PATH=$DEPS/usr" "-DPKG_CONFIG_EXECUTABLE=$DEPS/usr/bin/pkgconf")
  record bundle passed $((SECONDS - t)) "$("$PYTHON" -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read().splitlines()))' "$BUILD/bundle/MANIFEST")"
else
  record bundle passed $((SECONDS - t)) '"no .gpu_bundle/bundle.tar.xz: the system packages are used"'
fi

# 2. Configure and build against the Python's torch. Without a GPU, torch's CMake cannot read the
# architecture from the device: Hopper (the lent machines) unless TORCH_CUDA_ARCH_LIST says.
t=$SECONDS
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
source scripts/libtorch.sh  # the same LibTorch and NCCL arguments as SHARDIT_LIBTORCH=pip's build
mapfile -t libtorch_args < <(pip_libtorch_cmake_args "$TORCH_DIR")
if ! cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${libtorch_args[@]}" -DSHARDIT_BUILD_FUZZ=OFF \
     "${cmake_extra[@]}"; then
  record configure failed $((SECONDS - t)); exit 1
fi
record configure passed $((SECONDS - t))
t=$SECONDS
if ! cmake --build "$BUILD" -j "${SHARDIT_GPU_JOBS:-$(nproc)}" --target shardit_cli test_gpu shardit_bench; then
  record build failed $((SECONDS - t)); exit 1
fi
record build passed $((SECONDS - t))

# 3. What was built and what it runs on
t=$SECONDS
if "$BUILD/apps/shardit" version >"$OUT/version.txt" 2>&1; then
  cat "$OUT/version.txt"
  record version passed $((SECONDS - t)) "$("$PYTHON" -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()))' "$OUT/version.txt")"
else
  cat "$OUT/version.txt"; record version failed $((SECONDS - t))
fi

# 4. The golden transformer cases on CUDA
t=$SECONDS
"$BUILD/tests/test_gpu" --gtest_output="json:$OUT/cuda_transformers.json"
parity=$("$PYTHON" - "$OUT/cuda_transformers.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
cases = [c for s in report["testsuites"] for c in s["testsuite"]]
count = lambda result: sum(1 for c in cases if c.get("result") == result and not c.get("failures"))
print(json.dumps({"cases": len(cases), "failed": sum(1 for c in cases if c.get("failures")),
                  "skipped": count("SKIPPED"), "passed": count("COMPLETED")}))
PY
) || parity='{"cases": 0}'
status=$("$PYTHON" -c '
import json,sys; p=json.loads(sys.argv[1]); gpu=sys.argv[2]=="1"
ok = p["cases"] > 0 and p.get("failed", 1) == 0
print("failed" if not ok else ("passed" if p["skipped"] == 0 else ("failed" if gpu else "rehearsed")))' "$parity" "$HAVE_GPU")
record cuda_transformers "$status" $((SECONDS - t)) "$parity"

# 5. One FLUX.1-dev-width step against diffusers on the same device
if [ "$HAVE_GPU" = 1 ]; then
  shape=(--double 19 --single 38); pixels=1024; img=4096; label=passed
else
  shape=(--double 2 --single 4); pixels=256; img=256; label=rehearsed
fi
t=$SECONDS
if "$BUILD/bench/shardit-bench" --cache-dir "$BUILD/bench-cache" "${shape[@]}" --json "$OUT/shardit_step.json" \
     forward --height $pixels --width $pixels --text-tokens 512 --dtype bf16 --warmup 1 --repeats 3; then
  record shardit_step $label $((SECONDS - t)) "$(cat "$OUT/shardit_step.json")"
else
  record shardit_step failed $((SECONDS - t))
fi
rm -rf "$BUILD/bench-cache"  # the full-depth synthetic checkpoint is 24 GB
t=$SECONDS
if "$PYTHON" bench/diffusers_flux_step.py "${shape[@]}" --img $img --txt 512 --dtype bf16 --warmup 1 --repeat 3 \
     --json "$OUT/diffusers_step.json"; then
  ratio=$("$PYTHON" -c '
import json,sys; s=json.load(open(sys.argv[1])); d=json.load(open(sys.argv[2]))
print(json.dumps({"shardit_s": s["step_seconds"]["median"], "diffusers_s": d["step_seconds"]["median"],
                  "shardit_over_diffusers": s["step_seconds"]["median"] / d["step_seconds"]["median"],
                  "diffusers": d["diffusers"], "torch": d["torch"], "device": d["device"]}))' \
    "$OUT/shardit_step.json" "$OUT/diffusers_step.json" 2>/dev/null || echo null)
  record diffusers_step $label $((SECONDS - t)) "$ratio"
else
  record diffusers_step failed $((SECONDS - t))
fi
"$PYTHON" -c 'import json,sys; sys.exit(0 if all(json.loads(l)["status"] in ("passed","rehearsed") for l in open(sys.argv[1])) else 1)' "$STEPS"
