// Shared by the GPU test files: the skip that names why there is no GPU, and a CUDA call check
// that fails the test with the call's text and the runtime's message.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cucache/cuda_backend.hpp"

#define CUCACHE_REQUIRE_GPU() \
  if (!cucache::cuda_available()) GTEST_SKIP() << cucache::cuda_unavailable_reason()

// Evaluates `expr` once and FAILs (returning from the enclosing void function) with its text.
#define CUDA_CHECK(expr)                                                     \
  do {                                                                       \
    const cudaError_t cuda_check_code = (expr);                              \
    if (cuda_check_code != cudaSuccess)                                      \
      FAIL() << #expr << " failed: " << cudaGetErrorString(cuda_check_code); \
  } while (false)
