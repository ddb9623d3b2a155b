# Warnings as errors on cucache's own targets (never on dependencies).
# gcc 13 reports -Warray-bounds inside fmt 9's own headers (bigint::assign through
# basic_memory_buffer::grow, inlined into our code), a false positive that -Werror would turn into a
# broken build on such a machine (the H200's image); there it stays a warning.
function(cucache_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Werror>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>,$<VERSION_GREATER_EQUAL:$<CXX_COMPILER_VERSION>,13>>:-Wno-error=array-bounds>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Werror>)
endfunction()
