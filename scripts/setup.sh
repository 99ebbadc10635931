#!/usr/bin/env bash
# Installs every Debian package shardit needs to build, test and benchmark (bench/ uses only
# shardit itself and CLI11).
# Idempotent: re-running only installs what is missing. Needs root (or sudo).
#   --cli           only what configuring and building the CLI needs (the quick start): leaves out
#                   OpenMPI (the mpirun test) and clang (the fuzzer)
#   --bench-anchor  also the packages of the diffusers anchor that bench/compare runs side by side
#                   (Debian's CPU PyTorch and diffusers' pure-Python dependencies; not needed to
#                   build or test)
set -euo pipefail

packages=(
  # toolchain; xz unpacks the golden data's packed files (tests/golden/README.md)
  build-essential g++ cmake ninja-build ccache pkg-config git xz-utils
  # tensors and collectives: LibTorch (CPU, with c10d + Gloo) and Gloo's headers
  libtorch-dev libgloo-dev
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
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
