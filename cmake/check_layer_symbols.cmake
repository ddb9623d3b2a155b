# Nothing below calls up, checked on the built layers: every cucache symbol a layer's library
# leaves undefined must be defined by that layer or one below it. The include check (a layer sees
# only its own private headers and those of the layers below, cmake/cucache_layers.cmake) cannot
# see a call through a public header whose body lives in a higher layer -- this catches it at link
# level.
#   cmake -DNM=<nm> -DLAYERS=backend,core,... -DLIB_backend=<its archive> -DLIB_core=... ...
#         -P cmake/check_layer_symbols.cmake   (LAYERS bottom to top)
cmake_policy(SET CMP0057 NEW)  # if(... IN_LIST ...)
string(REPLACE "," ";" LAYERS "${LAYERS}")
list(LENGTH LAYERS n)
foreach(layer IN LISTS LAYERS)
  if(NOT EXISTS "${LIB_${layer}}")
    message(FATAL_ERROR "check_layer_symbols: no archive for layer ${layer} (LIB_${layer})")
  endif()
endforeach()
# The cucache symbols of one archive, defined or undefined: demangled names, one per line.
function(cucache_symbols lib which out)
  execute_process(COMMAND ${NM} -C ${which} ${lib} OUTPUT_VARIABLE text RESULT_VARIABLE rc
                  ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_layer_symbols: ${NM} ${which} ${lib} failed (${rc})")
  endif()
  string(REPLACE ";" "\\;" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(names "")
  foreach(line IN LISTS lines)
    # "<address> <type> <name>" for defined symbols, "<blank> U <name>" for undefined ones.
    if(line MATCHES "^[0-9a-f ]* [A-Za-z] (.*cucache::.*)$")
      list(APPEND names "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES names)
  set(${out} "${names}" PARENT_SCOPE)
endfunction()

set(below "")  # defined by the layers checked so far
set(bad "")
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  list(GET LAYERS ${i} layer)
  set(lib ${LIB_${layer}})
  cucache_symbols(${lib} --defined-only defined)
  cucache_symbols(${lib} --undefined-only undefined)
  list(APPEND below ${defined})
  foreach(sym IN LISTS undefined)
    if(NOT sym IN_LIST below)
      string(APPEND bad "\n  ${layer} uses ${sym}")
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "layers use cucache symbols that no layer at or below them defines "
                      "(a call up the layers):${bad}")
endif()
message(STATUS "${n} layers: every cucache symbol a layer uses is defined at or below it")
