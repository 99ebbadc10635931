#!/usr/bin/env bash
# Rehearses scripts/gpu_check.sh here, in a clean root that has only what the GPU machine has:
# Debian's minimal base with Python 3, g++, CMake and ninja, PyPI's torch in a venv (the GPU
# machine's is at /opt/torch/.venv, with numpy, Pillow, huggingface-hub, regex, safetensors,
# requests, filelock: diffusers' dependencies, which that machine has) and
# the CUDA toolkit, no -dev package of ours and no network while the check runs. A second run
# keeps the root and its build-gpu/ (an incremental build). The repository's
# tracked files and .gpu_bundle/ (make it first: scripts/gpu_bundle.sh) are copied in, as they
# travel to that machine. Without a GPU the check's CUDA steps report "rehearsed" (docs/building.md,
# "On a GPU").
#   sudo bash scripts/gpu_rehearsal.sh ROOT OUT_DIR
#   SHARDIT_REHEARSAL_TORCH   the torch to install (default 2.11.0, the GPU machine's)
#   CUDA_HOME                 the CUDA toolkit to mount (default /usr/local/cuda)
# Needs root (debootstrap, chroot, mounts, a network namespace) and the network to make the root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(mkdir -p "${1:?usage: gpu_rehearsal.sh ROOT OUT_DIR}" && cd "$1" && pwd)
OUT=$(mkdir -p "${2:?usage: gpu_rehearsal.sh ROOT OUT_DIR}" && cd "$2" && pwd)
TORCH_VERSION=${SHARDIT_REHEARSAL_TORCH:-2.11.0}
CUDA=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
[ -f .gpu_bundle/bundle.tar.xz ] || { echo "gpu_rehearsal: no .gpu_bundle/bundle.tar.xz: run scripts/gpu_bundle.sh" >&2; exit 1; }
[ -x "$CUDA/bin/nvcc" ] || { echo "gpu_rehearsal: no nvcc in $CUDA (set CUDA_HOME)" >&2; exit 1; }

if [ ! -x "$ROOT/opt/torch/.venv/bin/python3" ]; then
  command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap
  [ -x "$ROOT/usr/bin/python3" ] ||
    debootstrap --variant=minbase --include=python3,python3-venv,g++,cmake,ninja-build,ca-certificates \
      bookworm "$ROOT" http://deb.debian.org/debian
  # Downloads in the root trust what the host trusts (a proxy's CA included).
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca-certificates.crt"
  chroot "$ROOT" env -i PATH=/usr/bin:/bin HOME=/root PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt bash -c "python3 -m venv /opt/torch/.venv &&
    /opt/torch/.venv/bin/pip install -q torch==$TORCH_VERSION numpy pillow huggingface_hub regex safetensors \
      requests filelock"
fi

# The tree as it travels: tracked files (links as links) and the bundle.
mkdir -p "$ROOT/src" "$ROOT/out" "$ROOT$CUDA"
find "$ROOT/src" -mindepth 1 -maxdepth 1 ! -name build-gpu -exec rm -rf {} +
rm -rf "$ROOT/out"/*
git ls-files -z | tar --null -T - -cf - .gpu_bundle | tar -C "$ROOT/src" -xf -
mountpoint -q "$ROOT$CUDA" || mount --bind -o ro "$CUDA" "$ROOT$CUDA"
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
trap 'umount "$ROOT$CUDA" "$ROOT/proc" 2>/dev/null || true' EXIT
status=0
unshare -n chroot "$ROOT" env -i HOME=/root PATH="$CUDA/bin:/opt/torch/.venv/bin:/usr/bin:/bin" \
  SHARDIT_PYTHON=/opt/torch/.venv/bin/python3 bash /src/scripts/gpu_check.sh /out || status=$?
cp -r "$ROOT/out/." "$OUT/"
echo "gpu_rehearsal: gpu_check.sh exited $status; its files are in $OUT"
exit $status
