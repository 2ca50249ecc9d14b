# cmake -DHEADERS_DIR=<include/moh> -P no_bare_throw.cmake: fails if a library header raises an
# exception other than through MOH_THROW (error.hpp's fail()), so that a user's MOH_THROW sees
# every moh::Error. Allowed: the macro itself, and a thread pool rethrowing what a task threw.
file(GLOB_RECURSE headers "${HEADERS_DIR}/*.hpp")
set(found "")
foreach(header IN LISTS headers)
  file(STRINGS "${header}" lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    string(REGEX REPLACE "//.*$" "" code "${line}")  # comments may say "throws"
    if(code MATCHES "(^|[^A-Za-z_])throw([ (;]|$)" AND NOT code MATCHES "MOH_THROW")
      list(APPEND found "${header}:${n}: ${line}")
    endif()
  endforeach()
endforeach()
if(found)
  string(REPLACE ";" "\n  " found "${found}")
  message(FATAL_ERROR "bare throw in library headers (raise errors with detail::fail):\n  ${found}")
endif()
message(STATUS "no bare throw in ${HEADERS_DIR}")
