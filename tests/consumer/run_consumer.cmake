# Configures, builds and runs the consumer project in tests/consumer; run with `cmake -P`.
#
# Inputs (all -D):
#   CONSUMER_MODE          find_package | add_subdirectory
#   CONSUMER_SOURCE_DIR    tests/consumer
#   CONSUMER_BINARY_DIR    scratch build folder (wiped first)
#   CONSUMER_GENERATOR, CONSUMER_MAKE_PROGRAM, CONSUMER_CXX_COMPILER: copied from the parent build
#   CONSUMER_CONFIG        the parent's configuration, to install (empty for single-config generators)
#   CONSUMER_CTEST         path to ctest
#   find_package mode:     MOH_BINARY_DIR (the moh build to install), MOH_PREFIX (install prefix)
#   add_subdirectory mode: MOH_SOURCE_DIR (the moh source tree)
cmake_minimum_required(VERSION 3.19)

foreach(var CONSUMER_MODE CONSUMER_SOURCE_DIR CONSUMER_BINARY_DIR CONSUMER_CTEST)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${var} is required")
  endif()
endforeach()

# The consumer is built in Debug whatever the parent's configuration: it checks how moh is found
# and linked, not its speed, and -O0 compiles the layers in a third of the time.
set(config Debug)

set(configure_args
  -S "${CONSUMER_SOURCE_DIR}"
  -B "${CONSUMER_BINARY_DIR}"
  "-DCMAKE_BUILD_TYPE=${config}")
if(CONSUMER_GENERATOR)
  list(APPEND configure_args -G "${CONSUMER_GENERATOR}")
endif()
if(CONSUMER_MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${CONSUMER_MAKE_PROGRAM}")
endif()
if(CONSUMER_CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}")
endif()

if(CONSUMER_MODE STREQUAL "find_package")
  # A fresh prefix each run, so a stale install cannot hide a broken one.
  file(REMOVE_RECURSE "${MOH_PREFIX}")
  set(install_args --install "${MOH_BINARY_DIR}" --prefix "${MOH_PREFIX}")
  if(NOT CONSUMER_CONFIG STREQUAL "")
    list(APPEND install_args --config "${CONSUMER_CONFIG}")
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" ${install_args} COMMAND_ERROR_IS_FATAL ANY)
  list(APPEND configure_args
    "-DCMAKE_PREFIX_PATH=${MOH_PREFIX}"
    "-DMOH_EXPECTED_PREFIX=${MOH_PREFIX}")
elseif(CONSUMER_MODE STREQUAL "add_subdirectory")
  list(APPEND configure_args -DMOH_CONSUMER_USE_SUBDIR=ON "-DMOH_SOURCE_DIR=${MOH_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown CONSUMER_MODE '${CONSUMER_MODE}'")
endif()

file(REMOVE_RECURSE "${CONSUMER_BINARY_DIR}")
execute_process(COMMAND "${CMAKE_COMMAND}" ${configure_args} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${CONSUMER_BINARY_DIR}" --config "${config}"
  COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND "${CONSUMER_CTEST}" -C "${config}" --output-on-failure
  WORKING_DIRECTORY "${CONSUMER_BINARY_DIR}"
  COMMAND_ERROR_IS_FATAL ANY)
