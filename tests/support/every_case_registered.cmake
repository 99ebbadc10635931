# Fails when EXECUTABLE holds a test case that FILTER (the negation of every test file's patterns,
# tests/CMakeLists.txt) still lists: a case that no CTest entry would ever run.
#   cmake -DEXECUTABLE=path -DFILTER=-patterns -P every_case_registered.cmake
execute_process(COMMAND "${EXECUTABLE}" --gtest_list_tests "--gtest_filter=${FILTER}"
                OUTPUT_VARIABLE listed RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${EXECUTABLE} --gtest_list_tests exited with ${status}")
endif()
# --gtest_list_tests prints "Suite." lines, each followed by its "  Name" lines.
string(REGEX MATCHALL "(^|\n)[A-Za-z0-9_/]+\\.[^\n]*" suites "${listed}")
if(suites)
  message(FATAL_ERROR "${EXECUTABLE} has cases that no test file's suites cover (no CTest entry runs them):\n${listed}\n"
                      "Start each TEST, TEST_F and TEST_P at the beginning of a line (tests/CMakeLists.txt reads them).")
endif()
message(STATUS "every case of ${EXECUTABLE} belongs to a test file")
