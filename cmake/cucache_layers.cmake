# The library is built as one static library per layer, linked one way:
#
#   backend <- core <- allocator <- observe <- api <- (integrations, tools)
#
# Each layer's private headers live in src/<layer>/ and are included as "<layer>/name.hpp". A
# layer's include root (a folder in the build tree holding one link, <layer> -> src/<layer>) is
# given only to the layer itself and to the layers above it, so an include from a lower layer
# into a higher one does not compile. The public headers (include/cucache) are visible to all.
function(cucache_add_layer layer)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "SOURCES;DEPENDS;PRIVATE_LIBS")
  set(root ${PROJECT_BINARY_DIR}/cucache_layers/${layer})
  file(MAKE_DIRECTORY ${root})
  if(NOT EXISTS ${root}/${layer})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${layer} ${root}/${layer} SYMBOLIC)
  endif()
  add_library(cucache_${layer} STATIC ${arg_SOURCES})
  add_library(cucache::${layer} ALIAS cucache_${layer})
  target_include_directories(cucache_${layer}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>
           $<BUILD_INTERFACE:${root}>)
  target_link_libraries(cucache_${layer} PUBLIC ${arg_DEPENDS} PRIVATE ${arg_PRIVATE_LIBS})
  target_compile_features(cucache_${layer} PUBLIC cxx_std_20)
  cucache_set_warnings(cucache_${layer})
endfunction()
