# The include rules of the tools (tools/, bench/), checked on their sources:
#  1. no tool includes a private header of a library layer ("backend/x.hpp", "core/x.hpp", ...):
#     tools use the public headers (include/cucache) and tools/common only;
#  2. every quoted include names a public header ("cucache/x"), a file of tools/common
#     ("common/x"), a file in the including file's own folder, or a header generated into the build
#     tree (k_generated): so tools/common -- the one folder the replay, the benchmark and the peers
#     share -- includes nothing of tools/replay or bench/, and neither of those includes the other.
#     (Before, tools/common included bench/peers/c10_peer.h while bench/ used tools/common.)
#   cmake -DCUCACHE_SOURCE_DIR=<repo> -P cmake/check_tool_includes.cmake
cmake_policy(SET CMP0057 NEW)
set(k_generated timeline_resources.hpp)
file(GLOB_RECURSE sources
  ${CUCACHE_SOURCE_DIR}/tools/*.cpp ${CUCACHE_SOURCE_DIR}/tools/*.hpp ${CUCACHE_SOURCE_DIR}/tools/*.h
  ${CUCACHE_SOURCE_DIR}/tools/*.cu
  ${CUCACHE_SOURCE_DIR}/bench/*.cpp ${CUCACHE_SOURCE_DIR}/bench/*.hpp ${CUCACHE_SOURCE_DIR}/bench/*.h)
set(bad "")
set(crossing "")
foreach(src IN LISTS sources)
  file(RELATIVE_PATH rel ${CUCACHE_SOURCE_DIR} ${src})
  file(STRINGS ${src} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<](backend|core|allocator|observe|api|integrations)/")
  foreach(line IN LISTS lines)
    string(APPEND bad "\n  ${rel}: ${line}")
  endforeach()
  get_filename_component(dir ${src} DIRECTORY)
  file(STRINGS ${src} quoted REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS quoted)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\".*" "\\1" name "${line}")
    if(name MATCHES "(^|/)\\.\\.(/|$)")
      set(ok FALSE)
    elseif(name MATCHES "^cucache/" AND EXISTS ${CUCACHE_SOURCE_DIR}/include/${name})
      set(ok TRUE)
    elseif(name MATCHES "^common/" AND EXISTS ${CUCACHE_SOURCE_DIR}/tools/${name})
      set(ok TRUE)
    elseif(EXISTS ${dir}/${name} AND NOT IS_DIRECTORY ${dir}/${name})
      set(ok TRUE)
    elseif(name IN_LIST k_generated)
      set(ok TRUE)
    else()
      set(ok FALSE)
    endif()
    if(NOT ok)
      string(APPEND crossing "\n  ${rel}: \"${name}\"")
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "tools include private layer headers (use include/cucache or tools/common):${bad}")
endif()
if(crossing)
  message(FATAL_ERROR "tools include a file outside their own folder, tools/common and "
                      "include/cucache (what tools/replay and bench/ share belongs in tools/common, "
                      "which includes neither):${crossing}")
endif()
list(LENGTH sources n)
message(STATUS "${n} tool sources include public headers, tools/common and their own folder only")
