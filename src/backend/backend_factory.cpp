// Backend names, device counts and creation (include/cucache/backend_factory.hpp).
#include "cucache/backend_factory.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdlib>

#include "cucache/cuda_backend.hpp"
#include "cucache/errors.hpp"

namespace cucache {

// --- device_backend's defaults for the optional calls (backend.hpp) ------------------------------

namespace {
[[noreturn]] void not_supported(const device_backend& b, const char* call) {
  throw cuda_error(call, static_cast<int>(cudaErrorNotSupported),
                   fmt::format("the {} backend of device {} cannot share memory between processes",
                               b.name(), b.device()));
}
}  // namespace

void device_backend::enable_phys_export() {
  not_supported(*this, "enable_phys_export");
}
segment_ipc_handle device_backend::segment_export(void* /*base*/) {
  not_supported(*this, "segment_export");
}
void* device_backend::segment_import(const segment_ipc_handle& /*handle*/) {
  not_supported(*this, "segment_import");
}
void device_backend::segment_close(void* /*base*/) {
  not_supported(*this, "segment_close");
}
int device_backend::phys_export_fd(phys_handle /*handle*/) {
  not_supported(*this, "phys_export_fd");
}
phys_handle device_backend::phys_import_fd(int /*fd*/) {
  not_supported(*this, "phys_import_fd");
}

const char* to_string(backend_kind kind) noexcept {
  return kind == backend_kind::sim ? "sim" : "cuda";
}

backend_kind parse_backend_kind(std::string_view name, std::string_view source) {
  if (name.empty() || name == "cuda") return backend_kind::cuda;
  if (name == "sim") return backend_kind::sim;
  throw invalid_argument(fmt::format(
      "{}: unknown backend '{}' (accepted: cuda, sim; unset or empty means cuda)", source, name));
}

backend_kind backend_kind_from_env() {
  const char* env = std::getenv(k_backend_env);
  return parse_backend_kind(env != nullptr ? env : "",
                            fmt::format("environment variable {}", k_backend_env));
}

device_census count_devices(backend_kind kind) {
  device_census c;
  if (kind == backend_kind::sim) {
    c.count = 1;
    return c;
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count <= 0) {
    const cudaError_t code = err != cudaSuccess ? err : cudaErrorNoDevice;
    static_cast<void>(cudaGetLastError());
    c.error_code = static_cast<int>(code);
    c.error_message = cudaGetErrorString(code);
    return c;
  }
  c.count = count;
  return c;
}

int current_cuda_device() {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    throw cuda_error("cudaGetDevice", static_cast<int>(err), cudaGetErrorString(err));
  }
  return device;
}

int try_current_cuda_device() noexcept {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return -1;
  }
  return device;
}

std::shared_ptr<device_backend> make_backend(backend_kind kind, int device, sim_options sim) {
  if (kind == backend_kind::sim) {
    sim.device = device;
    return std::make_shared<sim_backend>(sim);
  }
  return std::make_shared<cuda_backend>(device);
}

}  // namespace cucache
