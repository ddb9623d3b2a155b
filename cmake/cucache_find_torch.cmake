# Locates an installed torch package (its folder, holding include/ and lib/) through python3, for
# the optional targets that compile against PyTorch's C++ headers. Never required: sets
# CUCACHE_TORCH_FOUND_DIR to "" when there is no torch. CUCACHE_TORCH_DIR, when set, wins (e.g. an
# unpacked wheel). Also sets CUCACHE_TORCH_CXX11_ABI (0 or 1).
function(cucache_find_torch)
  set(dir "${CUCACHE_TORCH_DIR}")
  set(abi 1)
  if(NOT dir)
    find_program(CUCACHE_PYTHON NAMES python3 python)
    if(CUCACHE_PYTHON)
      execute_process(
        COMMAND ${CUCACHE_PYTHON} -c
          "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
        OUTPUT_VARIABLE out ERROR_QUIET RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(rc EQUAL 0)
        string(REPLACE "\n" ";" out "${out}")
        list(GET out 0 dir)
        list(GET out 1 abi)
      endif()
    endif()
  endif()
  set(CUCACHE_TORCH_FOUND_DIR "${dir}" PARENT_SCOPE)
  set(CUCACHE_TORCH_CXX11_ABI "${abi}" PARENT_SCOPE)
endfunction()
