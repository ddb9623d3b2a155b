# Fails when a tool (tools/, bench/) includes a private header of a library layer ("backend/x.hpp",
# "core/x.hpp", ...): tools use the public headers (include/cucache) and tools/common only.
#   cmake -DCUCACHE_SOURCE_DIR=<repo> -P cmake/check_tool_includes.cmake
file(GLOB_RECURSE sources
  ${CUCACHE_SOURCE_DIR}/tools/*.cpp ${CUCACHE_SOURCE_DIR}/tools/*.hpp ${CUCACHE_SOURCE_DIR}/tools/*.h
  ${CUCACHE_SOURCE_DIR}/bench/*.cpp ${CUCACHE_SOURCE_DIR}/bench/*.hpp ${CUCACHE_SOURCE_DIR}/bench/*.h)
set(bad "")
foreach(src IN LISTS sources)
  file(STRINGS ${src} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<](backend|core|allocator|observe|api|integrations)/")
  foreach(line IN LISTS lines)
    file(RELATIVE_PATH rel ${CUCACHE_SOURCE_DIR} ${src})
    string(APPEND bad "\n  ${rel}: ${line}")
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "tools include private layer headers (use include/cucache or tools/common):${bad}")
endif()
list(LENGTH sources n)
message(STATUS "${n} tool sources include public headers and tools/common only")
