# The library is built as one static library per layer, linked one way:
#
#   backend <- core <- allocator <- observe <- api <- (integrations, tools)
#
# Each layer's private headers live in src/<layer>/ and are included as "<layer>/name.hpp". A
# layer's include root (a folder in the build tree holding one link, <layer> -> src/<layer>) is
# given only to the layer itself and to the layers above it, so an include from a lower layer
# into a higher one does not compile. The public headers (include/cucache) are visible to all, so
# the tests check the rest (tests/CMakeLists.txt): layering_upward_include / _downward_include (the
# include roots), layering_symbols (no layer's archive uses a cucache symbol defined only above it,
# cmake/check_layer_symbols.cmake), layering_config_in_core (the configuration and its parser are
# the core's: a program linking the core alone parses a config), and
# tools_include_only_public_headers (the tools' folders, cmake/check_tool_includes.cmake).
#
# DEPENDS are public (a layer below, or what the public headers need); PRIVATE_LIBS are linked
# privately, and, the layers being static, still reach the link line of whoever links the layer
# (so the installed package must find them too: cmake/cucacheConfig.cmake.in). BUILD_ONLY are
# header-only libraries the layer compiles with and that never reach anyone's link line or the
# installed package (fmt's header-only target, nlohmann_json).
#
# Each layer is installed and exported as cucache::<layer> (cmake/cucache_package.cmake), and its
# objects are what the shared libcucache is made of when BUILD_SHARED_LIBS is ON.
function(cucache_add_layer layer)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "SOURCES;DEPENDS;PRIVATE_LIBS;BUILD_ONLY")
  set(root ${PROJECT_BINARY_DIR}/cucache_layers/${layer})
  file(MAKE_DIRECTORY ${root})
  if(NOT EXISTS ${root}/${layer})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${layer} ${root}/${layer} SYMBOLIC)
  endif()
  add_library(cucache_${layer} STATIC ${arg_SOURCES})
  add_library(cucache::${layer} ALIAS cucache_${layer})
  set_target_properties(cucache_${layer} PROPERTIES EXPORT_NAME ${layer})
  target_include_directories(cucache_${layer}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
           $<BUILD_INTERFACE:${root}>)
  set(build_only)
  foreach(lib IN LISTS arg_BUILD_ONLY)
    list(APPEND build_only $<BUILD_INTERFACE:${lib}>)
  endforeach()
  target_link_libraries(cucache_${layer} PUBLIC ${arg_DEPENDS} PRIVATE ${arg_PRIVATE_LIBS} ${build_only})
  target_compile_features(cucache_${layer} PUBLIC cxx_std_20)
  cucache_set_warnings(cucache_${layer})
  set_property(GLOBAL APPEND PROPERTY CUCACHE_LAYERS cucache_${layer})
endfunction()
