# [Suites as tests] (tests/CMakeLists.txt), run after each build of a test binary: lists its
# GoogleTest suites (--gtest_list_tests) and writes CTEST_FILE, which ctest includes, with one test
# per suite that runs the binary on that suite's cases. Variables: TEST_EXECUTABLE, CTEST_FILE,
# LABEL, TIMEOUT.
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE status
                TIMEOUT 120)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${status}):\n${listing}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(content "")
foreach(line IN LISTS lines)
  # A suite's line starts in column 0 and ends its name with '.' ("Instance/Suite.  # GetParam..." too).
  if(line MATCHES "^([^ #][^ ]*)\\.")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND content
      "add_test([=[${suite}]=] [=[${TEST_EXECUTABLE}]=] [=[--gtest_filter=${suite}.*]=])\n"
      "set_tests_properties([=[${suite}]=] PROPERTIES LABELS ${LABEL} TIMEOUT ${TIMEOUT})\n")
  endif()
endforeach()
file(WRITE "${CTEST_FILE}" "${content}")
