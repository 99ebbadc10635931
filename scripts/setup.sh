#!/usr/bin/env bash
# Installs every Debian package shardit needs to build, test and benchmark.
# Idempotent: re-running only installs what is missing. Needs root (or sudo).
set -euo pipefail

packages=(
  # toolchain
  build-essential g++ cmake ninja-build ccache pkg-config git
  # tensors and collectives: LibTorch (CPU, with c10d + Gloo) and Gloo's headers
  libtorch-dev libgloo-dev
  # fast BLAS for LibTorch; without it Debian's reference BLAS is ~40x slower
  libopenblas0-openmp
  # libraries
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev libpng-dev
  # tokenizers: SentencePiece (T5), PCRE2 (pre-tokenizer regexes), ICU (normalisation, case mapping)
  libsentencepiece-dev libpcre2-dev libicu-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # multi-process launcher tests
  openmpi-bin libopenmpi-dev
  # fuzzing (libFuzzer ships with clang's runtime)
  clang libclang-rt-14-dev
)

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
