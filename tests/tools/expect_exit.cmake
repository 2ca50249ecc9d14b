# Runs one command and checks how it ended; used by the tools_* tests.
#
#   cmake -DEXPECT_EXIT=1 "-DEXPECT_LINE_0=<regex>" ["-DEXPECT_LINE_1=<regex>" ...]
#         -P expect_exit.cmake -- PROGRAM [ARGS...]
#
# Passes when PROGRAM exits with exactly EXPECT_EXIT (a crash or a signal never does), each
# EXPECT_LINE_<i> (a CMake regex) matches at least one line of its stdout + stderr, and no sanitizer
# reported anything (AddressSanitizer and UBSan exit with 1 too, so the code alone is not enough).
cmake_minimum_required(VERSION 3.16)

if(NOT DEFINED EXPECT_EXIT OR NOT DEFINED EXPECT_LINE_0)
  message(FATAL_ERROR "expect_exit.cmake: -DEXPECT_EXIT=... and -DEXPECT_LINE_0=... are required")
endif()

set(command)
set(after_separator OFF)
math(EXPR last_arg "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last_arg})
  if(after_separator)
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif("${CMAKE_ARGV${i}}" STREQUAL "--")
    set(after_separator ON)
  endif()
endforeach()
if(NOT command)
  message(FATAL_ERROR "expect_exit.cmake: expected '-- PROGRAM [ARGS...]' after -P, got none")
endif()

execute_process(COMMAND ${command} RESULT_VARIABLE exit_code OUTPUT_VARIABLE output
  ERROR_VARIABLE output)
string(REPLACE ";" " " command_text "${command}")
set(report "command: ${command_text}\nexit: ${exit_code}\noutput:\n${output}")

# True in `result` when `regex` matches one line of `text` (so "." never spans two lines).
function(matches_a_line text regex result)
  set(${result} OFF PARENT_SCOPE)
  while(NOT text STREQUAL "")
    string(FIND "${text}" "\n" newline)
    if(newline EQUAL -1)
      set(line "${text}")
      set(text "")
    else()
      string(SUBSTRING "${text}" 0 ${newline} line)
      math(EXPR newline "${newline} + 1")
      string(SUBSTRING "${text}" ${newline} -1 text)
    endif()
    if(line MATCHES "${regex}")
      set(${result} ON PARENT_SCOPE)
      return()
    endif()
  endwhile()
endfunction()

if(NOT "${exit_code}" STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "expected exit code ${EXPECT_EXIT}, got '${exit_code}'\n${report}")
endif()
if(output MATCHES "Sanitizer|runtime error:")
  message(FATAL_ERROR "expected no sanitizer report, got one\n${report}")
endif()
set(i 0)
while(DEFINED EXPECT_LINE_${i})
  matches_a_line("${output}" "${EXPECT_LINE_${i}}" found)
  if(NOT found)
    message(FATAL_ERROR "expected a line matching '${EXPECT_LINE_${i}}', got none\n${report}")
  endif()
  math(EXPR i "${i} + 1")
endwhile()
message(STATUS "ok: exit ${exit_code}, ${i} expected line(s) found\n${report}")
