// Finding, loading and initializing the c10 peer shim (c10_loader.hpp).
#include "common/c10_loader.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <system_error>

#include "cucache/errors.hpp"

namespace cucache::tools {
namespace {

constexpr const char* k_file = "libcucache_c10_peer.so";

template <class Fn>
Fn symbol(void* lib, const std::filesystem::path& path, const char* name) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    throw error(fmt::format("c10 peer: {} lacks {}; rebuild it (tools/build_c10_peer.sh)",
                            path.string(), name));
  }
  // POSIX guarantees that dlsym's object pointer converts to a function pointer.
  return reinterpret_cast<Fn>(p);
}

}  // namespace

std::filesystem::path c10_peer_path() {
  if (const char* env = std::getenv("CUCACHE_C10_PEER"); env != nullptr && env[0] != '\0') {
    return env;
  }
  std::error_code ec;
  const auto dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  if (ec) return k_file;  // dlopen's own search (LD_LIBRARY_PATH, the cache)
  const auto beside = dir / k_file;
  if (std::filesystem::exists(beside, ec)) return beside;
  if (auto lib = dir.parent_path() / "lib" / k_file; std::filesystem::exists(lib, ec)) return lib;
  return beside;
}

void c10_peer_library::fail(const char* what) const {
  throw error(fmt::format("c10 peer: {} failed: {}", what, last_error()));
}

void c10_peer_library::set_memory_fraction(double fraction) const {
  if (set_memory_fraction_(fraction) != 0) fail("set_memory_fraction");
}

cucache_c10_stats c10_peer_library::stats() const {
  cucache_c10_stats s{};
  if (stats_(&s) != 0) fail("stats");
  return s;
}

void c10_peer_library::reset() const {
  if (reset_() != 0) fail("reset");
}

std::string c10_peer_library::last_error() const {
  const char* why = last_error_();
  return why != nullptr && why[0] != '\0' ? why : "no message";
}

const c10_peer_library& load_c10_peer(const std::string& conf) {
  // c10's global state lives as long as the process: one shim per process, never unloaded.
  static std::unique_ptr<c10_peer_library> loaded;
  if (loaded) throw error("c10 peer: already loaded in this process (one per process)");
  auto lib = std::unique_ptr<c10_peer_library>(new c10_peer_library);
  lib->path_ = c10_peer_path();
  lib->conf_ = conf;
  const std::string path = lib->path_.string();
  if (lib->path_.has_parent_path() && !std::filesystem::exists(lib->path_)) {
    throw error(fmt::format(
        "c10 peer: {} not found (build it with tools/build_c10_peer.sh on a machine with torch, "
        "or set CUCACHE_C10_PEER)",
        path));
  }
  // PyTorch reads PYTORCH_ALLOC_CONF and still PYTORCH_CUDA_ALLOC_CONF (which one wins depends
  // on its version): both say `conf`, so a caller's setting under either name cannot leak in.
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    if (conf.empty()) {
      ::unsetenv(name);
    } else {
      ::setenv(name, conf.c_str(), 1);
    }
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    throw error(fmt::format("c10 peer: dlopen {}: {}", path, why != nullptr ? why : "unknown"));
  }
  const auto abi = symbol<cucache_peer_c10_abi_fn>(handle, lib->path_, "cucache_peer_c10_abi");
  if (const int version = abi(); version != CUCACHE_C10_PEER_ABI) {
    throw error(fmt::format("c10 peer: {} has interface version {}, expected {}; rebuild it", path,
                            version, CUCACHE_C10_PEER_ABI));
  }
  lib->init_ = symbol<cucache_peer_c10_init_fn>(handle, lib->path_, "cucache_peer_c10_init");
  lib->alloc_ = symbol<cucache_peer_c10_alloc_fn>(handle, lib->path_, "cucache_peer_c10_alloc");
  lib->free_ = symbol<cucache_peer_c10_free_fn>(handle, lib->path_, "cucache_peer_c10_free");
  lib->set_memory_fraction_ = symbol<cucache_peer_c10_set_memory_fraction_fn>(
      handle, lib->path_, "cucache_peer_c10_set_memory_fraction");
  lib->stats_ = symbol<cucache_peer_c10_stats_fn>(handle, lib->path_, "cucache_peer_c10_stats");
  lib->reset_ = symbol<cucache_peer_c10_reset_fn>(handle, lib->path_, "cucache_peer_c10_reset");
  lib->last_error_ =
      symbol<cucache_peer_c10_last_error_fn>(handle, lib->path_, "cucache_peer_c10_last_error");
  // Loaded from here on, whatever init says: a second attempt would meet c10's state again.
  loaded = std::move(lib);
  if (loaded->init_(conf.c_str()) != 0) loaded->fail(fmt::format("init(\"{}\")", conf).c_str());
  return *loaded;
}

}  // namespace cucache::tools
