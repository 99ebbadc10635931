#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs the whole suite under CTest
# and prints a summary (cases per label, the slowest cases, how to rerun each failed case alone).
# Extra args go to CTest (e.g. -L unit, -R test_tp_toy, -LE golden).
#   SHARDIT_TEST_JOBS  cases run at once (default: the number of cores). A case that starts
#                      several ranks reserves that many (its PROCESSORS), so multi-rank cases never
#                      share the cores with another case (tests/CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
BUILD_DIR=${SHARDIT_BUILD_DIR:-build}
JOBS=${SHARDIT_TEST_JOBS:-$(nproc)}
JUNIT="$(cd "$BUILD_DIR" && pwd)/Testing/junit.xml"
rm -f "$JUNIT"
status=0
start=$SECONDS
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 -j "$JOBS" --output-junit "$JUNIT" "$@" || status=$?
echo "CTest: $((SECONDS - start)) s wall with -j $JOBS on $(nproc) cores"
bash scripts/test_summary.sh "$BUILD_DIR" "$JUNIT"
exit $status
