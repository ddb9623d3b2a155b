// Choosing and creating device backends: the one place that maps a backend's name (the
// CUCACHE_BACKEND environment variable, a tool's --backend flag) to a device_backend, counts the
// devices of a kind and asks the runtime for the current device. Every front end (the global
// API, the C API, the PyTorch plug-in, the replay and the benchmark) creates backends here.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/backend_factory.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "cucache/backend.hpp"
#include "cucache/sim_backend.hpp"

namespace cucache {

/// The kinds of device a backend can drive.
enum class backend_kind : std::uint8_t {
  cuda,  ///< a real GPU through the CUDA runtime and driver (cuda_backend)
  sim,   ///< the simulated device (sim_backend)
};

/// "cuda" or "sim".
[[nodiscard]] const char* to_string(backend_kind kind) noexcept;

/// Parses a backend name: "cuda" or "sim"; empty means cuda. Throws invalid_argument naming
/// `source` (e.g. "environment variable CUCACHE_BACKEND") and the accepted values otherwise.
[[nodiscard]] backend_kind parse_backend_kind(std::string_view name, std::string_view source);

/// The name of the environment variable every front end reads the backend from.
inline constexpr const char* k_backend_env = "CUCACHE_BACKEND";

/// Reads CUCACHE_BACKEND (unset or empty: cuda). Throws invalid_argument on an unknown value; read
/// again on every call, nothing is cached.
[[nodiscard]] backend_kind backend_kind_from_env();

/// What a machine has of one backend kind.
struct device_census {
  int count = 0;  ///< usable devices; the simulated backend always has one
  /// Why CUDA is unusable (count == 0): the runtime's error code and text; 0 / empty otherwise.
  int error_code = 0;
  std::string error_message;
};

/// Counts the devices of `kind`. Never throws for an unusable CUDA: the census says why.
[[nodiscard]] device_census count_devices(backend_kind kind);

/// The calling thread's current CUDA device (cudaGetDevice). Throws cuda_error when the runtime
/// fails; the runtime's error slot is cleared so the caller's next cudaGetLastError does not see
/// it.
[[nodiscard]] int current_cuda_device();
/// As current_cuda_device, without throwing: -1 when the runtime fails.
[[nodiscard]] int try_current_cuda_device() noexcept;

/// Creates the backend of device `device` of `kind`. `sim` gives the simulated device's options
/// (its device field is overwritten by `device`); ignored for cuda. Throws what the backend's
/// constructor throws (cuda_error for an unusable or out-of-range device).
[[nodiscard]] std::shared_ptr<device_backend> make_backend(backend_kind kind, int device,
                                                           sim_options sim = {});

}  // namespace cucache
