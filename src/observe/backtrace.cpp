// Call-stack capture and symbolization (backtrace.hpp).
#include "observe/backtrace.hpp"

#include <cxxabi.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <string>

#if CUCACHE_HAVE_BACKTRACES
#define UNW_LOCAL_ONLY
#include <libunwind.h>
#endif

namespace cucache::detail {

namespace {
// capture_backtrace, the observer's record call and the observer itself: not the caller's.
constexpr int k_skipped_frames = 3;
constexpr int k_max_frames = 64;

#if CUCACHE_HAVE_BACKTRACES
// libunwind, loaded on first use (CMakeLists.txt says why it is not linked). The header's
// declaration gives the type, so a mismatch with the installed version does not compile.
using unw_backtrace_fn = decltype(&unw_backtrace);
struct unwinder {
  unw_backtrace_fn fn = nullptr;
  std::string error;
};
const unwinder& load_unwinder() {
  static const unwinder u = [] {
    unwinder out;
    void* h = dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      out.error = e != nullptr ? e : "dlopen(libunwind.so.8) failed";
      return out;
    }
    out.fn = reinterpret_cast<unw_backtrace_fn>(dlsym(h, "unw_backtrace"));
    if (out.fn == nullptr) out.error = "libunwind.so.8 has no unw_backtrace";
    return out;
  }();
  return u;
}
#endif
}  // namespace

std::string backtraces_unavailable_reason() {
#if CUCACHE_HAVE_BACKTRACES
  return load_unwinder().error;
#else
  return "this build of cucache has no call-stack capture (built without libunwind-dev)";
#endif
}

bool backtraces_available() noexcept {
#if CUCACHE_HAVE_BACKTRACES
  try {
    return load_unwinder().fn != nullptr;
  } catch (...) {
    return false;
  }
#else
  return false;
#endif
}

std::shared_ptr<const backtrace> capture_backtrace() noexcept {
#if CUCACHE_HAVE_BACKTRACES
  const unw_backtrace_fn unwind = load_unwinder().fn;
  if (unwind == nullptr) return nullptr;
  std::array<void*, k_max_frames + k_skipped_frames> buf{};
  const int n = unwind(buf.data(), static_cast<int>(buf.size()));
  try {
    auto bt = std::make_shared<backtrace>();
    for (int i = k_skipped_frames; i < n; ++i) bt->ips.push_back(buf[static_cast<std::size_t>(i)]);
    return bt;
  } catch (...) {
    return nullptr;
  }
#else
  return nullptr;
#endif
}

std::vector<frame> symbolize(const backtrace& bt) {
  std::vector<frame> out;
  out.reserve(bt.ips.size());
  for (void* ip : bt.ips) {
    frame f;
    Dl_info info{};
    // A return address points after the call; one byte back is inside the calling instruction.
    const auto* at = static_cast<const char*>(ip) - 1;
    if (dladdr(at, &info) != 0) {
      if (info.dli_fname != nullptr) f.filename = info.dli_fname;
      if (info.dli_sname != nullptr) {
        int status = 0;
        char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        f.name = status == 0 && demangled != nullptr ? demangled : info.dli_sname;
        std::free(demangled);
      } else {
        f.name = fmt::format("0x{:x}", reinterpret_cast<std::uintptr_t>(at) -
                                           reinterpret_cast<std::uintptr_t>(info.dli_fbase));
      }
    } else {
      f.filename = "??";
      f.name = fmt::format("{}", ip);
    }
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace cucache::detail
