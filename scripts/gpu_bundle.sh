#!/usr/bin/env bash
# Makes what scripts/gpu_check.sh needs on a GPU machine that has Python with PyPI's torch, nvcc,
# CMake and ninja but none of our Debian -dev packages and no network: .gpu_bundle/bundle.tar.xz,
# one file holding
#   deps/     our build dependencies (scripts/setup.sh's libraries but LibTorch, which the GPU
#             machine's Python brings): their Debian packages fetched with `apt-get download` and
#             unpacked with `dpkg -x` into this prefix (never into /), pruned to headers, shared
#             libraries, GoogleTest's static ones, CMake and pkg-config files;
#   python/   the diffusers wheel (pinned below), unpacked: the yardstick gpu_check.sh times. The
#             GPU machine's Python already has its dependencies (numpy, Pillow, huggingface-hub,
#             regex, safetensors).
#   MANIFEST  the package versions.
# The repository's working tree plus this file must stay within 64 MiB (what may be copied to such
# a machine): the tree is checked at 49 MiB (scripts/check_tree_size.sh), this file is ~14 MB.
# Run on Debian 12 (it asks apt, which needs no root for `download`); needs network once.
set -euo pipefail
cd "$(dirname "$0")/.."
DIFFUSERS_VERSION=0.42.1
BUNDLE_DIR=.gpu_bundle
packages=(
  nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libpng-dev libpng16-16 zlib1g zlib1g-dev
  libjpeg62-turbo-dev libjpeg62-turbo libcpp-httplib-dev libcpp-httplib0.11 libbrotli1 libbrotli-dev libssl-dev
  libsentencepiece-dev libsentencepiece0 libpcre2-dev libpcre2-8-0 libicu-dev libicu72
  libgtest-dev libgmock-dev libgloo-dev pkgconf pkgconf-bin libpkgconf3 xz-utils liblzma5
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/bundle/deps" "$work/bundle/python" "$BUNDLE_DIR"

echo "gpu_bundle: fetching ${#packages[@]} Debian packages"
(cd "$work/debs" && apt-get download "${packages[@]}" >/dev/null)
for deb in "$work"/debs/*.deb; do
  dpkg -x "$deb" "$work/bundle/deps"
  dpkg-deb -f "$deb" Package Version | paste -sd' ' >>"$work/bundle/MANIFEST"
done

# Pruned to what building and running needs. cpp-httplib is built with OpenSSL, Brotli and zlib:
# their headers and pkg-config files come along; the OpenSSL libraries themselves (libssl3) are on
# any machine whose Python has its ssl module, so they are not carried.
deps="$work/bundle/deps"
lib="$deps/usr/lib/x86_64-linux-gnu"
rm -rf "$deps/usr/share/doc" "$deps/usr/share/man" "$deps/usr/share/lintian" "$deps/usr/share/info" "$deps/usr/share/icu"
find "$deps" -name '*.a' ! -name 'libgtest*.a' ! -name 'libgmock*.a' -delete
rm -f "$lib"/libpcre2-16.so* "$lib"/libpcre2-32.so* "$lib"/libpcre2-posix.so* \
      "$lib"/libicuio.so* "$lib"/libicutest.so* "$lib"/libicutu.so*
find "$deps" -xtype l -delete  # links to what was pruned

echo "gpu_bundle: fetching diffusers ${DIFFUSERS_VERSION}"
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$work/wheel" "diffusers==${DIFFUSERS_VERSION}"
python3 -m zipfile -e "$work"/wheel/diffusers-*.whl "$work/bundle/python"
echo "python diffusers ${DIFFUSERS_VERSION}" >>"$work/bundle/MANIFEST"

tar -C "$work/bundle" -cf - deps python MANIFEST | xz -9 -T0 >"$BUNDLE_DIR/bundle.tar.xz.part"
mv "$BUNDLE_DIR/bundle.tar.xz.part" "$BUNDLE_DIR/bundle.tar.xz"
echo "gpu_bundle: $BUNDLE_DIR/bundle.tar.xz, $(du -m "$BUNDLE_DIR/bundle.tar.xz" | cut -f1) MiB ($(wc -l <"$work/bundle/MANIFEST") entries)"
