# fabric-core's C++ engine core, for the compiled backends (fabric-efa, fabric-verbs):
#
#   find_package(FabricCore CONFIG REQUIRED
#                HINTS "${CMAKE_CURRENT_SOURCE_DIR}/../fabric-core/src/fabric_core/cmake")
#   pybind11_add_module(_mine csrc/module.cpp)
#   fabric_core_backend(_mine)
#
# An installed fabric-core is found through its `cmake.root` entry point (scikit-build-core
# sets FabricCore_ROOT to the installed package), a build from the repository through the hint.
#
# fabric_core_backend(<target>): the engine core's headers (#include <fabric/engine.hpp>), the
# warnings and optimisation every backend builds with, threads, and the sanitizer option:
# FABRIC_SANITIZE=address,undefined (a -fsanitize= list; `nox -s sanitize`). Empty, the default,
# leaves the normal build as it is. Every report is fatal (no recovery), and -O1 comes after
# -O2, so it wins.
get_filename_component(FABRIC_CORE_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/../include" ABSOLUTE)
if(NOT EXISTS "${FABRIC_CORE_INCLUDE}/fabric/engine.hpp")
  set(FabricCore_FOUND FALSE)
  set(FabricCore_NOT_FOUND_MESSAGE "fabric-core's C++ headers are not beside ${CMAKE_CURRENT_LIST_FILE}")
  return()
endif()

set(FABRIC_SANITIZE "" CACHE STRING "sanitizers to build with, as a -fsanitize= list (empty: none)")
find_package(Threads REQUIRED)

function(fabric_core_backend target)
  target_include_directories(${target} PRIVATE "${FABRIC_CORE_INCLUDE}")
  target_compile_options(${target} PRIVATE -Wall -Wextra -O2)
  if(FABRIC_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${FABRIC_SANITIZE} -fno-sanitize-recover=all
                                              -fno-omit-frame-pointer -g -O1)
    target_link_options(${target} PRIVATE -fsanitize=${FABRIC_SANITIZE})
  endif()
  target_link_libraries(${target} PRIVATE Threads::Threads)
endfunction()
