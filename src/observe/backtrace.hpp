// Allocation call stacks (CUCACHE_CONF=record_backtraces:True): captured as return addresses
// with libunwind's unw_backtrace (no symbol lookup on the allocation path), turned into frames
// only when a snapshot or leak report shows them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cucache/observe.hpp"

namespace cucache::detail {

struct backtrace {
  std::vector<void*> ips;  // innermost first
};

/// True when call stacks can be captured: the build had libunwind's header and libunwind.so.8
/// loads (it is loaded on first use, not linked).
[[nodiscard]] bool backtraces_available() noexcept;
/// Why not, when backtraces_available() is false ("" otherwise).
[[nodiscard]] std::string backtraces_unavailable_reason();
/// The calling thread's stack, minus the frames inside cucache's recording code; nullptr when
/// the build has no libunwind or the host is out of memory.
[[nodiscard]] std::shared_ptr<const backtrace> capture_backtrace() noexcept;
/// Frames for the addresses of `bt` (dladdr and the C++ demangler): object file, function name.
[[nodiscard]] std::vector<frame> symbolize(const backtrace& bt);

}  // namespace cucache::detail
