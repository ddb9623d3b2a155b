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
}  // namespace

bool backtraces_available() noexcept {
  return CUCACHE_HAVE_BACKTRACES != 0;
}

std::shared_ptr<const backtrace> capture_backtrace() noexcept {
#if CUCACHE_HAVE_BACKTRACES
  std::array<void*, k_max_frames + k_skipped_frames> buf{};
  const int n = unw_backtrace(buf.data(), static_cast<int>(buf.size()));
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
