# cucache::cucache, the library users link, and everything that lets another project find it: the
# install rules, the CMake package (cucacheConfig.cmake, cucacheConfigVersion.cmake and the
# exported targets, for the install and for this build tree) and cucache.pc for pkg-config.
#
# Static (the default): cucache::cucache is an INTERFACE target over the layer archives
# (cucache::api, which links observe, allocator, core and backend). The archives are installed
# and exported as they are; their private link dependencies (the static CUDA runtime, zlib,
# Threads, libdl) are part of the export, so cucacheConfig.cmake finds CUDAToolkit, Threads and
# ZLIB. fmt and nlohmann_json are header-only and used only to compile the layers: they are not
# part of the export (cucache_add_layer's BUILD_ONLY).
#
# BUILD_SHARED_LIBS=ON: cucache::cucache is one shared libcucache.so made of the layers' objects
# (the layers themselves stay static archives of position-independent code, for the tests and
# tools). It carries the static CUDA runtime inside and exports only cucache's own symbols
# (cmake/cucache_shared.map), so it can share a process with any other copy of the runtime, fmt
# or zlib. VERSION is the project version, SOVERSION MAJOR.MINOR (before 1.0 a minor release may
# change the ABI); cucacheConfigVersion.cmake accepts the same major.minor.
get_property(CUCACHE_LAYER_TARGETS GLOBAL PROPERTY CUCACHE_LAYERS)

if(BUILD_SHARED_LIBS)
  set(_objects)
  foreach(layer IN LISTS CUCACHE_LAYER_TARGETS)
    list(APPEND _objects $<TARGET_OBJECTS:${layer}>)
  endforeach()
  add_library(cucache SHARED ${_objects})
  target_include_directories(cucache PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  # The public headers include cuda_runtime_api.h: consumers get the toolkit's include directory.
  # The archives after the objects add nothing but their link dependencies (every symbol is
  # already defined by the objects); a shared library's private dependencies are not exported.
  target_link_libraries(cucache PUBLIC CUDA::toolkit PRIVATE cucache_api)
  target_compile_features(cucache PUBLIC cxx_std_20)
  set(_map ${PROJECT_SOURCE_DIR}/cmake/cucache_shared.map)
  target_link_options(cucache PRIVATE -Wl,--version-script=${_map} -Wl,--no-undefined)
  set_target_properties(cucache PROPERTIES
    VERSION ${PROJECT_VERSION}
    SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
    LINK_DEPENDS ${_map})
  set(CUCACHE_EXPORTED_TARGETS cucache)
else()
  add_library(cucache INTERFACE)
  target_link_libraries(cucache INTERFACE cucache_api)
  target_compile_features(cucache INTERFACE cxx_std_20)
  set(CUCACHE_EXPORTED_TARGETS ${CUCACHE_LAYER_TARGETS} cucache)
endif()
add_library(cucache::cucache ALIAS cucache)

include(CMakePackageConfigHelpers)
set(CUCACHE_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/cucache)
set(_pkg ${PROJECT_BINARY_DIR}/cucache_package)
if(BUILD_SHARED_LIBS)
  set(CUCACHE_PACKAGE_SHARED ON)
else()
  set(CUCACHE_PACKAGE_SHARED OFF)
endif()
# The toolkit cucache was built with: the package looks there when the consumer names none.
get_filename_component(CUCACHE_CUDA_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)

write_basic_package_version_file(${_pkg}/cucacheConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
# One template, two configurations: the install's, and the build tree's (find_package with
# cucache_DIR=<build>, or export(PACKAGE)); both include the cucacheTargets.cmake beside them.
set(CUCACHE_PACKAGE_BUILD_TREE FALSE)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cucacheConfig.cmake.in
  ${_pkg}/cucacheConfig.cmake INSTALL_DESTINATION ${CUCACHE_CMAKE_INSTALL_DIR})
# The build tree's targets keep the layers' BUILD_INTERFACE links (fmt, nlohmann_json): its
# configuration finds them too.
set(CUCACHE_PACKAGE_BUILD_TREE TRUE)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cucacheConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cucacheConfig.cmake
  INSTALL_DESTINATION ${PROJECT_BINARY_DIR} INSTALL_PREFIX ${PROJECT_BINARY_DIR})
file(COPY_FILE ${_pkg}/cucacheConfigVersion.cmake ${PROJECT_BINARY_DIR}/cucacheConfigVersion.cmake
     ONLY_IF_DIFFERENT)
export(TARGETS ${CUCACHE_EXPORTED_TARGETS} NAMESPACE cucache::
       FILE ${PROJECT_BINARY_DIR}/cucacheTargets.cmake)

# cucache.pc. Paths inside the prefix are relative to the .pc file, so the install can be moved
# (and `cmake --install --prefix P` works); the toolkit's paths are absolute.
set(CUCACHE_PC_PREFIX "\${pcfiledir}")
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(CUCACHE_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  string(REPLACE "/" ";" _parts "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  foreach(_part IN LISTS _parts)
    string(APPEND CUCACHE_PC_PREFIX "/..")
  endforeach()
endif()
list(GET CUDAToolkit_INCLUDE_DIRS 0 CUCACHE_PC_CUDA_INCLUDE_DIR)
set(CUCACHE_PC_CCCL_INCLUDE_DIR "${CUCACHE_PC_CUDA_INCLUDE_DIR}")
if(EXISTS "${CUCACHE_PC_CUDA_INCLUDE_DIR}/cccl/cuda/memory_resource")
  set(CUCACHE_PC_CCCL_INCLUDE_DIR "${CUCACHE_PC_CUDA_INCLUDE_DIR}/cccl")
endif()
if(BUILD_SHARED_LIBS)
  set(CUCACHE_PC_LIBS "-L\${libdir} -lcucache")
else()
  # Everything a static link needs, in link order: pkg-config --libs works without --static,
  # there being no shared library to prefer. -lstdc++ -lm let a C compiler driver do the link.
  set(CUCACHE_PC_LIBS "-L\${libdir}")
  foreach(layer api observe allocator core backend)
    string(APPEND CUCACHE_PC_LIBS " -lcucache_${layer}")
  endforeach()
  string(APPEND CUCACHE_PC_LIBS
    " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -lz -lrt -ldl -lpthread -lstdc++ -lm")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/cucache.pc.in ${_pkg}/cucache.pc @ONLY)

if(CUCACHE_INSTALL)
  install(TARGETS ${CUCACHE_EXPORTED_TARGETS} EXPORT cucacheTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  # The public headers only: the layers' own headers (src/<layer>/) are never installed.
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/cucache DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
    FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")
  install(EXPORT cucacheTargets NAMESPACE cucache:: DESTINATION ${CUCACHE_CMAKE_INSTALL_DIR})
  install(FILES ${_pkg}/cucacheConfig.cmake ${_pkg}/cucacheConfigVersion.cmake
    DESTINATION ${CUCACHE_CMAKE_INSTALL_DIR})
  install(FILES ${_pkg}/cucache.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endif()
