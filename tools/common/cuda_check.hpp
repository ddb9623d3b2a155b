// The tools' one CUDA runtime error helper. A failed call becomes a cucache::cuda_error naming the
// call; the runtime's per-thread last-error slot is cleared only when it holds the error this
// call returned, so an older error that someone else still has to see stays where it was, and
// the error reported here does not resurface at the next, unrelated cudaGetLastError.
#pragma once

#include <cuda_runtime_api.h>

namespace cucache::tools {

/// Does nothing when `code` is cudaSuccess. Otherwise clears the last-error slot if it holds
/// `code` and throws cucache::cuda_error(call, code, cudaGetErrorString(code)).
void check_cuda(cudaError_t code, const char* call);

/// For a call with one expected failure (cudaErrorMemoryAllocation, say): true when `code` is
/// cudaSuccess; false when it is `expected`, after clearing that error from the last-error slot
/// (only that one); throws as check_cuda for any other failure.
[[nodiscard]] bool check_cuda_expecting(cudaError_t code, cudaError_t expected, const char* call);

}  // namespace cucache::tools
