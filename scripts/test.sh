#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs the whole suite under CTest
# and prints a summary (cases per label, the slowest cases, how to rerun each failed case alone).
# Extra args go to CTest (e.g. -L unit, -R test_tp_toy, -LE golden).
#   SHARDIT_LIBTORCH   debian (default) or pip: which LibTorch, and its build folder
#                      (scripts/libtorch.sh); `SHARDIT_LIBTORCH=pip bash scripts/test.sh` installs
#                      PyPI's torch into ./build-pip and tests that build.
#   SHARDIT_TEST_JOBS  computing entries CTest runs at once (default: the number of cores). CTest
#                      runs one entry per test file; the entries of files that start ranks run one
#                      at a time (a lock), beside the others, and one file whose ranks mostly wait
#                      beside those (each entry takes 2 of the 2 x JOBS + 1 slots given to CTest's
#                      -j, such a file 1; tests/CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh
bash scripts/setup.sh
bash scripts/build.sh
JOBS=${SHARDIT_TEST_JOBS:-$(nproc)}
JUNIT="$(cd "$BUILD_DIR" && pwd)/Testing/junit.xml"
rm -f "$JUNIT"
rm -rf "$BUILD_DIR/Testing/gtest"  # each entry's GoogleTest report, read by the summary
status=0
start=$SECONDS
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 -j $((2 * JOBS + 1)) --output-junit "$JUNIT" "$@" || status=$?
echo "CTest: $((SECONDS - start)) s wall with -j $((2 * JOBS + 1)) ($JOBS computing entries at once) on $(nproc) cores"
bash scripts/test_summary.sh "$BUILD_DIR" "$JUNIT"
exit $status
