#!/usr/bin/env bash
# Installs every Debian package shardit needs to build, test and benchmark (bench/ uses only
# shardit itself and CLI11).
# Idempotent: re-running only installs what is missing. Needs root (or sudo).
#   --cli           only what configuring and building the CLI needs (the quick start): leaves out
#                   OpenMPI (the mpirun test) and clang (the fuzzer)
#   --bench-anchor  also the packages of the diffusers anchor that bench/compare runs side by side
#                   (Debian's CPU PyTorch and diffusers' pure-Python dependencies; not needed to
#                   build or test)
# With SHARDIT_LIBTORCH=pip (scripts/libtorch.sh) it installs python3-venv instead of Debian's
# LibTorch, checks that the CUDA toolkit is there, and installs the torch wheel pinned in
# scripts/torch-pip.txt into a virtual environment in the build folder, from a folder of wheels
# that keeps the download for the next fresh build folder (SHARDIT_WHEEL_CACHE, default
# ~/.cache/shardit/wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh

packages=(
  # toolchain; xz unpacks the golden data's packed files (tests/golden/README.md)
  build-essential g++ cmake ninja-build ccache pkg-config git xz-utils
  # collectives: Gloo's headers (c10d's ProcessGroupGloo.hpp includes them)
  libgloo-dev
  # fast BLAS for LibTorch; without it Debian's reference BLAS is ~40x slower
  libopenblas0-openmp
  # Sleef's header: at::vec's AVX headers include it (the fused CPU kernels, nn/cpu)
  libsleef-dev
  # libraries
  nlohmann-json3-dev libcli11-dev libfmt-dev libpng-dev
  # input images for editing: JPEG
  libjpeg62-turbo-dev
  # `shardit serve`: HTTP
  libcpp-httplib-dev
  # tokenizers: SentencePiece (T5), PCRE2 (pre-tokenizer regexes), ICU (normalisation, case mapping)
  libsentencepiece-dev libpcre2-dev libicu-dev
  # tests (configuring the project needs GoogleTest even when only the CLI is built)
  libgtest-dev libgmock-dev
)
if [ "$SHARDIT_LIBTORCH" = debian ]; then
  # tensors and collectives: LibTorch (CPU, with c10d + Gloo)
  packages+=(libtorch-dev)
else
  # the virtual environment that holds PyPI's torch
  packages+=(python3-venv)
fi
if [ "${1:-}" != "--cli" ]; then
  packages+=(
    # the official openai client's test (tests/client): a virtual environment for the client from
    # PyPI, and curl for the docs' example
    python3 python3-venv curl
    # multi-process launcher tests; iproute2 makes the two-host test's network namespaces
    openmpi-bin libopenmpi-dev iproute2
    # fuzzing (libFuzzer ships with clang's runtime)
    clang libclang-rt-14-dev
  )
fi
if [ "${1:-}" = "--bench-anchor" ]; then
  packages+=(
    python3-torch python3-numpy python3-filelock python3-packaging python3-regex python3-tqdm
    python3-fsspec python3-httpx python3-yaml python3-requests python3-typing-extensions python3-pil
  )
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
else
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  echo "setup: done"
fi
[ "$SHARDIT_LIBTORCH" = pip ] || exit 0

# The wheel's LibTorch is a CUDA build: configuring against it needs the CUDA toolkit (nvcc,
# the CUDA runtime's headers), which Debian does not package.
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: SHARDIT_LIBTORCH=pip needs the CUDA toolkit (nvcc, 13.x like the torch wheel): install it" \
       "from NVIDIA (it goes to /usr/local/cuda) or put its bin/ on PATH" >&2
  exit 1
fi
wanted="$TORCH_VENV/torch-pip.txt"  # what the environment holds: the list it was installed from
if [ -x "$TORCH_VENV/bin/python" ] && cmp -s scripts/torch-pip.txt "$wanted"; then
  echo "setup: $TORCH_VENV has the packages of scripts/torch-pip.txt"
  exit 0
fi
if ! "$SHARDIT_PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
  echo "setup: $SHARDIT_PYTHON cannot make a virtual environment (ensurepip, venv): install python3-venv" \
       "or set SHARDIT_PYTHON to a Python that can" >&2
  exit 1
fi
# The wheels are kept in a folder of their own, so that the next fresh build folder (or clone)
# installs them without downloading again (pip's own HTTP cache keeps nothing where the index
# answers "no-store").
wheels=${SHARDIT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardit/wheels}
start=$SECONDS
mkdir -p "$BUILD_DIR" "$wheels"
rm -f "$wanted"
[ -x "$TORCH_VENV/bin/python" ] || "$SHARDIT_PYTHON" -m venv "$TORCH_VENV"
pip=("$TORCH_VENV/bin/python" -m pip --disable-pip-version-check)
if ! "${pip[@]}" download --quiet --no-index --find-links "$wheels" --dest "$wheels" -r scripts/torch-pip.txt \
     >/dev/null 2>&1; then
  echo "setup: downloading the wheels of scripts/torch-pip.txt into $wheels (~3 GB)"
  "${pip[@]}" download --progress-bar off --dest "$wheels" -r scripts/torch-pip.txt
  echo "setup: downloaded in $((SECONDS - start)) s"
fi
echo "setup: installing scripts/torch-pip.txt into $TORCH_VENV from $wheels"
"${pip[@]}" install --quiet --no-index --find-links "$wheels" -r scripts/torch-pip.txt
cp scripts/torch-pip.txt "$wanted"
echo "setup: torch installed in $((SECONDS - start)) s"
