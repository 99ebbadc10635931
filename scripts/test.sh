#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs the whole suite under CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
BUILD_DIR=${SHARDIT_BUILD_DIR:-build}
# Tests run one at a time: the dist tests start several ranks each and this is a 2-core machine.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 "$@"
