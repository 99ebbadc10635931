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
# The pinned PyPI packages some tests run (tests/CMakeLists.txt, tests/unit/test_gguf_reference.cpp),
# each in its virtual environment in the build folder, installed while the build compiles: pip
# mostly waits on the network, and done by the tests themselves it held a slot of the suite (the
# OpenAI client's, the `ranks` lock). The tests still make or check their environment; a failure
# here is only reported (the test that needs it says why).
mkdir -p "$BUILD_DIR/tests"
VENV_LOG="$BUILD_DIR/tests/venvs.log"
(
  python3 tests/client/test_openai_client.py --venv "$BUILD_DIR/tests/openai-client-venv" --only-venv &
  python3 tests/golden/tools/make_single_file_cases.py --venv "$BUILD_DIR/tests/single-file-venv" --only-venv &
  python3 tests/golden/tools/make_gguf_cases.py --venv "$BUILD_DIR/tests/gguf-venv" --only-venv &
  status=0
  for job in $(jobs -p); do wait "$job" || status=1; done
  exit $status
) >"$VENV_LOG" 2>&1 &
venvs=$!
bash scripts/build.sh
wait "$venvs" || echo "test: a test's virtual environment could not be made now (the test retries): $VENV_LOG"
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
