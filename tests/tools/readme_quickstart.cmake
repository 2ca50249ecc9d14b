# cmake -DREADME=<README.md> -DEXAMPLE=<examples/quickstart.cpp> -P readme_quickstart.cmake: the
# README's quick start (the first ```cpp block after "## Quick start") must be the example file
# itself, so that the code a reader copies is code that CI builds and runs.
file(READ "${README}" readme)
string(FIND "${readme}" "## Quick start" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${README}: no '## Quick start' section")
endif()
string(SUBSTRING "${readme}" ${at} -1 rest)
string(FIND "${rest}" "```cpp\n" open)
if(open EQUAL -1)
  message(FATAL_ERROR "${README}: no ```cpp block after '## Quick start'")
endif()
math(EXPR open "${open} + 7")
string(SUBSTRING "${rest}" ${open} -1 rest)
string(FIND "${rest}" "```" close)
string(SUBSTRING "${rest}" 0 ${close} block)
file(READ "${EXAMPLE}" example)
if(NOT block STREQUAL example)
  message(FATAL_ERROR "the README's quick start differs from ${EXAMPLE}: paste the file into "
                      "the ```cpp block after '## Quick start'")
endif()
message(STATUS "the README's quick start is ${EXAMPLE}")
