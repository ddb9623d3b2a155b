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

/// A kernel still running when the host acts: spins for `spin_ns` nanoseconds of the GPU's global
/// timer, then fills p[0..n) with v (one block; launch it with <<<1, threads>>>).
template <class T>
__global__ void spin_then_fill(T* p, std::size_t n, T v, unsigned long long spin_ns) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > spin_ns) break;
  }
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}
