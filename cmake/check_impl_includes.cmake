# Fails when a file outside src/allocator includes the allocator's internals, allocator_impl.hpp:
# other layers, tools and tests read the allocator through its public interface
# (include/cucache/device_allocator.hpp: stats, take_snapshot, segments, ...), and the allocator's
# own tests through its named parts (pool_table.hpp, pager.hpp, graph_pools.hpp, ...).
#   cmake -DCUCACHE_SOURCE_DIR=<repo> -P cmake/check_impl_includes.cmake
set(sources)
foreach(dir src include tests tools bench integrations python)
  file(GLOB_RECURSE found
    ${CUCACHE_SOURCE_DIR}/${dir}/*.cpp ${CUCACHE_SOURCE_DIR}/${dir}/*.hpp
    ${CUCACHE_SOURCE_DIR}/${dir}/*.h ${CUCACHE_SOURCE_DIR}/${dir}/*.cu ${CUCACHE_SOURCE_DIR}/${dir}/*.cc)
  list(APPEND sources ${found})
endforeach()
set(bad "")
foreach(src IN LISTS sources)
  file(RELATIVE_PATH rel ${CUCACHE_SOURCE_DIR} ${src})
  # (tests/layering/impl_include_fixture breaks the rule on purpose: the control's input.)
  if(rel MATCHES "^src/allocator/" OR rel MATCHES "impl_include_fixture/")
    continue()
  endif()
  file(STRINGS ${src} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<][^\">]*allocator_impl\\.hpp[\">]")
  foreach(line IN LISTS lines)
    string(APPEND bad "\n  ${rel}: ${line}")
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "allocator_impl.hpp is included outside src/allocator (use the public "
                      "interface, include/cucache/device_allocator.hpp):${bad}")
endif()
list(LENGTH sources n)
message(STATUS "${n} sources outside src/allocator leave allocator_impl.hpp alone")
