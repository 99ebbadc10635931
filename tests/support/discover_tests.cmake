# Registers the cases of one test executable with CTest, one entry per test file (two when some of
# its cases read the golden data and some do not), each running that file's cases in one process
# by their GoogleTest full names (`Suite.Name`, or `Instance/Suite.Name/Param` for TEST_P).
# CTest includes this when it starts (TEST_INCLUDE_FILES); tests/CMakeLists.txt sets before it:
#   executable          the test executable of one folder
#   label, timeout      the folder's label and the timeout of one entry
#   xml_dir             where each entry writes GoogleTest's XML report
#   golden_always       ON when every case reads the golden data (parity/)
#   file_of_<Suite>     the test file (without .cpp) that defines each suite
#   starts_ranks_<file> ON when cases of that file start ranks
#   light_ranks_<file>  ON when those rank groups keep a core busy or less (their own lock)
#   fixtures_<file>     CTest fixtures its entries require (made by setup entries beside them)
# The executable lists its cases once, and again only after it is rebuilt (the list is kept beside
# it). A case whose suite no file defines (a TEST the configure step could not read) gets an entry
# that fails naming it, so no case drops out of the suite unseen.

set(listing "${executable}.cases")
if(NOT EXISTS "${executable}")
  add_test("${label}.ExecutableIsBuilt" "${CMAKE_COMMAND}" -E echo "${executable} is not built: build the tests first")
  set_tests_properties("${label}.ExecutableIsBuilt" PROPERTIES WILL_FAIL ON LABELS "${label}")
  return()
endif()
if(NOT EXISTS "${listing}" OR "${executable}" IS_NEWER_THAN "${listing}")
  execute_process(COMMAND "${executable}" --gtest_list_tests OUTPUT_VARIABLE listed ERROR_VARIABLE errors
                  RESULT_VARIABLE status TIMEOUT 120)
  if(NOT status EQUAL 0)
    add_test("${label}.CasesCanBeListed" "${CMAKE_COMMAND}" -E echo
             "${executable} --gtest_list_tests failed (${status}): ${errors}")
    set_tests_properties("${label}.CasesCanBeListed" PROPERTIES WILL_FAIL ON LABELS "${label}")
    return()
  endif()
  file(WRITE "${listing}" "${listed}")
else()
  file(READ "${listing}" listed)
endif()

# --gtest_list_tests prints "Suite." (or "Instance/Suite.") lines, each followed by its cases
# indented by two spaces; a parameterized case ends in "  # GetParam() = ..." (dropped: it may
# hold any character, addresses included, and is not part of the name).
string(REGEX REPLACE "  #[^\n]*" "" listed "${listed}")
string(REPLACE "\n" ";" lines "${listed}")
set(suite_prefix "")
set(suite "")
set(files "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([A-Za-z0-9_/]*)\\.$")
    set(suite_prefix "${CMAKE_MATCH_1}.")
    string(REGEX REPLACE "^.*/" "" suite "${CMAKE_MATCH_1}")
  elseif(line MATCHES "^  ([A-Za-z0-9_/]+)$")
    set(case "${suite_prefix}${CMAKE_MATCH_1}")
    if(NOT DEFINED file_of_${suite})
      add_test("${label}.${case}.BelongsToNoFile" "${CMAKE_COMMAND}" -E echo
               "${case}: no test file defines suite ${suite}; start each TEST, TEST_F and TEST_P at the "
               "beginning of a line (tests/CMakeLists.txt reads them)")
      set_tests_properties("${label}.${case}.BelongsToNoFile" PROPERTIES WILL_FAIL ON LABELS "${label}")
      continue()
    endif()
    set(file "${file_of_${suite}}")
    if(NOT DEFINED cases_of_${file}_plain AND NOT DEFINED cases_of_${file}_golden)
      list(APPEND files "${file}")
    endif()
    if(golden_always OR case MATCHES "Golden")
      list(APPEND cases_of_${file}_golden "${case}")
    else()
      list(APPEND cases_of_${file}_plain "${case}")
    endif()
  endif()
endforeach()

# One entry per file and kind of case: `<file>` runs its cases that need no golden data,
# `<file>.golden` those that read it (a file with one kind only has just `<file>`). The cases run
# in one process, one after the other, as GoogleTest runs them; each writes its result to
# <xml_dir>/<entry>.xml, which scripts/test_summary.sh counts case by case.
foreach(file IN LISTS files)
  foreach(kind plain golden)
    if(NOT DEFINED cases_of_${file}_${kind})
      continue()
    endif()
    set(name "${file}")
    if(kind STREQUAL "golden" AND DEFINED cases_of_${file}_plain)
      set(name "${file}.golden")
    endif()
    set(labels "${label}")
    if(kind STREQUAL "golden")
      list(APPEND labels golden)
    endif()
    list(LENGTH cases_of_${file}_${kind} case_count)
    string(REPLACE ";" ":" filter "${cases_of_${file}_${kind}}")
    string(REPLACE ";" "," labels_env "${labels}")
    add_test("${name}" "${executable}" "--gtest_filter=${filter}" --gtest_also_run_disabled_tests
             "--gtest_output=xml:${xml_dir}/${name}.xml")
    set_tests_properties("${name}" PROPERTIES
      LABELS "${labels}"
      TIMEOUT ${timeout}
      # More cases first, so that long entries do not start last.
      COST ${case_count}
      SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]"
      # A thread spinning at an OpenMP barrier while its partner waits for a core (two entries
      # share the cores) makes a run many times slower; waiting passively changes no arithmetic.
      ENVIRONMENT "SHARDIT_TEST_LABELS=${labels_env};OMP_WAIT_POLICY=passive"
      # Two of CTest's slots (scripts/test.sh gives it 2 per core and one more): as many computing
      # entries at once as there are cores; a light rank group (below) takes the odd slot.
      PROCESSORS 2)
    if(DEFINED fixtures_${file})
      set_tests_properties("${name}" PROPERTIES FIXTURES_REQUIRED "${fixtures_${file}}")
    endif()
    if(starts_ranks_${file})
      # One rank group at a time (never two sharing the cores), beside at most one single-process
      # entry (CTest's -j); first, since together they are the longest path. Light groups
      # (light_ranks_<file>) hold a lock of their own and take one slot, the odd one: they run
      # beside a computing rank group and a single-process entry, not instead of the latter.
      set(lock ranks)
      set(processors 2)
      if(light_ranks_${file})
        set(lock light_ranks)
        set(processors 1)
      endif()
      math(EXPR cost "${case_count} + 1000")
      set_tests_properties("${name}" PROPERTIES RESOURCE_LOCK ${lock} COST ${cost} PROCESSORS ${processors})
    endif()
  endforeach()
endforeach()
