# Sanitizer and fuzzer builds (docs/testing.md). Included by the top-level CMakeLists.txt before any
# target is defined, so every target of the build -- the library layers, the tests, the tools, the
# GPU tests' host code -- is instrumented alike (a sanitizer needs all of a process's code built
# with it to report without false positives).
#
#   CUCACHE_SANITIZE=address,undefined   AddressSanitizer (with LeakSanitizer) + UBSan
#   CUCACHE_SANITIZE=thread              ThreadSanitizer
#   CUCACHE_BUILD_FUZZERS=ON             libFuzzer harnesses (tests/fuzz; clang only), with
#                                        coverage instrumentation of the whole library
#
# gcc and clang both work for the sanitizers; the fuzzers need clang (Debian's clang and
# libclang-rt-dev, which tools/install_deps.sh installs). UBSan is made fatal
# (-fno-sanitize-recover), so a report fails the test that triggered it.
set(CUCACHE_SANITIZE "" CACHE STRING
    "Sanitizers for every target: empty, address, undefined, address,undefined or thread")
option(CUCACHE_BUILD_FUZZERS "Build the libFuzzer harnesses in tests/fuzz (clang only)" OFF)

set(CUCACHE_SANITIZER_FLAGS "")
if(CUCACHE_SANITIZE)
  string(REPLACE "," ";" _cucache_san_list "${CUCACHE_SANITIZE}")
  foreach(s IN LISTS _cucache_san_list)
    if(NOT s MATCHES "^(address|undefined|thread)$")
      message(FATAL_ERROR "CUCACHE_SANITIZE: unknown sanitizer '${s}' "
                          "(accepted: address, undefined, thread)")
    endif()
  endforeach()
  if("thread" IN_LIST _cucache_san_list AND "address" IN_LIST _cucache_san_list)
    message(FATAL_ERROR "CUCACHE_SANITIZE: thread and address cannot be combined")
  endif()
  # -O1: the usual trade of a sanitizer build (fast enough to run the suite, exact stacks); it
  # overrides the build type's level. -g1 (line tables and functions) is all a sanitizer's stack
  # needs. The tests' own code is built at -O0 (cucache_add_test, tests/CMakeLists.txt): under
  # ASan + UBSan gcc takes ten times longer at -O1 on the big typed suites (allocator_suite.cpp:
  # 182 s at -O1 -g1, 28 s at -O0 -g1, one core), and a test's time is the library's.
  list(APPEND CUCACHE_SANITIZER_FLAGS "-fsanitize=${CUCACHE_SANITIZE}" -fno-omit-frame-pointer -g1 -O1)
  if("undefined" IN_LIST _cucache_san_list)
    # Every UB report is an error; float-divide-by-zero is defined (inf/nan) under IEEE 754 and
    # not part of -fsanitize=undefined anyway.
    list(APPEND CUCACHE_SANITIZER_FLAGS -fno-sanitize-recover=undefined)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # With the sanitizers' instrumentation gcc 12 reports -Wmaybe-uninitialized inside libstdc++'s
    # own <regex> (std::function members of _NFA's states, seen in trace_recorder_test): false
    # positives that -Werror turns into a broken build. The plain build keeps the warning.
    list(APPEND CUCACHE_SANITIZER_FLAGS -Wno-maybe-uninitialized)
  endif()
  message(STATUS "cucache: sanitizers ${CUCACHE_SANITIZE}")
endif()

# nvcc compiles the GPU tests' host code with its own host compiler (g++ by default); a process
# must not mix gcc's and clang's sanitizer runtimes, so nvcc uses the C++ compiler of the build.
if((CUCACHE_SANITIZE OR CUCACHE_BUILD_FUZZERS) AND NOT DEFINED CMAKE_CUDA_HOST_COMPILER)
  set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER} CACHE FILEPATH "nvcc's host compiler")
endif()

set(CUCACHE_FUZZ_COMPILE_FLAGS "")
if(CUCACHE_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "CUCACHE_BUILD_FUZZERS needs clang (libFuzzer): configure with "
                        "-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang")
  endif()
  # Coverage feedback for the library; only the harness executables link libFuzzer's main.
  set(CUCACHE_FUZZ_COMPILE_FLAGS -fsanitize=fuzzer-no-link)
endif()

# True when every target is instrumented: uninstrumented programs (python3 loading the PyTorch
# plug-in) cannot load the libraries, and shared libraries keep the runtime's symbols undefined.
if(CUCACHE_SANITIZER_FLAGS OR CUCACHE_FUZZ_COMPILE_FLAGS)
  set(CUCACHE_INSTRUMENTED ON)
else()
  set(CUCACHE_INSTRUMENTED OFF)
endif()

if(CUCACHE_INSTRUMENTED)
  # C and C++ directly; nvcc passes them to its host compiler. Linking is done by the host
  # compiler for every language here (CMake links CUDA executables through it as well).
  # -Xcompiler splits its argument at commas, so each sanitizer gets a -fsanitize of its own there.
  foreach(flag IN LISTS CUCACHE_SANITIZER_FLAGS CUCACHE_FUZZ_COMPILE_FLAGS)
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:${flag}>)
    if(flag MATCHES "^-fsanitize=(.*)$")
      string(REPLACE "," ";" _cucache_parts "${CMAKE_MATCH_1}")
      foreach(part IN LISTS _cucache_parts)
        add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fsanitize=${part}>)
      endforeach()
    elseif(flag MATCHES "^-fno-sanitize-recover=(.*)$")
      add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fno-sanitize-recover=all>)
    else()
      add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${flag}>)
    endif()
  endforeach()
  add_link_options(${CUCACHE_SANITIZER_FLAGS} ${CUCACHE_FUZZ_COMPILE_FLAGS})
endif()
