// The tools' CUDA runtime error helper (cuda_check.hpp).
#include "common/cuda_check.hpp"

#include "cucache/errors.hpp"

namespace cucache::tools {
namespace {

void clear_if_last(cudaError_t code) noexcept {
  if (cudaPeekAtLastError() == code) static_cast<void>(cudaGetLastError());
}

}  // namespace

void check_cuda(cudaError_t code, const char* call) {
  if (code == cudaSuccess) return;
  clear_if_last(code);
  throw cuda_error(call, static_cast<int>(code), cudaGetErrorString(code));
}

bool check_cuda_expecting(cudaError_t code, cudaError_t expected, const char* call) {
  if (code == cudaSuccess) return true;
  if (code != expected) check_cuda(code, call);
  clear_if_last(code);
  return false;
}

}  // namespace cucache::tools
