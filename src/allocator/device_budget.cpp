// device_budget's own invariant check (the rest of the budget is in its header).
#include "allocator/device_budget.hpp"

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace cucache::detail {

void device_budget::check_invariants(std::size_t counted) const {
  const auto violated = [](const std::string& what) {
    throw std::logic_error("cucache invariant violated: " + what);
  };
  detail::lock_guard lock(mu);
  if (reserved != counted) {
    violated(fmt::format("device reserved {} != sum of segments {}", reserved, counted));
  }
  if (const std::size_t cap = limit.load(std::memory_order_relaxed);
      cap != 0 && reserved > std::max(cap, above_limit_)) {
    violated(fmt::format("reserved {} exceeds the memory limit {}", reserved, cap));
  }
  if (peak < reserved) {
    violated(fmt::format("peak reserved {} is below reserved {}", peak, reserved));
  }
}

}  // namespace cucache::detail
