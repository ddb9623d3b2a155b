// Sleep and wake of a sleep domain: the allocator's public calls, each handing the sleeper its
// parts (impl::sleeper_parts) -- tag_sleeper.hpp / tag_sleeper.cpp hold the argument checks,
// every pool lock and the walk (docs/design.md, "Sleep and wake").
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <span>
#include <string_view>
#include <utility>

#include "allocator/allocator_impl.hpp"
#include "core/format_bytes.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::stream_pool;


// --- public shell -------------------------------------------------------------------------------

void device_allocator::set_thread_sleep_domain(std::uint32_t domain) {
  detail::tag_sleeper::check_domain(domain == 0 ? 1 : domain, "set_thread_sleep_domain");
  detail::t_sleep_domain = domain;
}
std::uint32_t device_allocator::thread_sleep_domain() noexcept {
  return detail::t_sleep_domain;
}
void device_allocator::sleep(std::uint32_t domain, bool keep_contents, std::string_view label,
                             const std::function<void(std::size_t)>& check) {
  const sleep_request one{domain, keep_contents, label, check};
  sleep(std::span<const sleep_request>(&one, 1));
}
void device_allocator::sleep(std::span<const sleep_request> requests) {
  impl_->sleeper.sleep_requested(impl_->sleeper_parts(), impl_->cfg.expandable_segments,
                                 requests);
}
std::size_t device_allocator::prepare_sleep(std::uint32_t domain, std::size_t bytes,
                                            std::string_view label) {
  return impl_->sleeper.prepare_sleep(impl_->sleeper_parts(), impl_->cfg.expandable_segments,
                                      domain, bytes, std::string(label));
}
std::size_t device_allocator::sleep_buffer_bytes(std::uint32_t domain) const {
  if (domain == 0 || domain > detail::k_max_sleep_domain) return 0;
  return impl_->sleeper.spare_bytes_locking(impl_->pools, domain);
}
void device_allocator::wake(std::uint32_t domain, std::string_view label) {
  const wake_request one{domain, label};
  wake(std::span<const wake_request>(&one, 1));
}
void device_allocator::wake(std::span<const wake_request> requests) {
  impl_->sleeper.wake_requested(impl_->sleeper_parts(), requests);
}
std::vector<device_allocator::sleep_state> device_allocator::sleeping() const {
  detail::pool_table::all_locked all(impl_->pools);
  std::vector<sleep_state> out;
  for (const auto& [domain, r] : impl_->sleeper.records()) {
    out.push_back({domain, r.sleeping_bytes, r.host_bytes, r.copy_seconds});
  }
  return out;
}
double device_allocator::last_wake_copy_seconds(std::uint32_t domain) const {
  detail::pool_table::all_locked all(impl_->pools);
  const auto& m = impl_->sleeper.last_copy_in();
  const auto it = m.find(domain);
  return it != m.end() ? it->second : 0.0;
}

bool device_allocator::is_asleep(std::uint32_t domain) const {
  if (domain == 0 || domain > detail::k_max_sleep_domain) return false;
  detail::pool_table::all_locked all(impl_->pools);
  return impl_->sleeper.asleep(domain);
}

std::size_t device_allocator::domain_requested_bytes(std::uint32_t domain) const {
  if (domain == 0) return 0;
  detail::pool_table::all_locked all(impl_->pools);
  std::int64_t n = 0;
  for (const auto& q : impl_->pools) {
    detail::pool_table::assert_locked(*q);
    if (q->domain == domain && q->graph == nullptr) n += q->stats.requested_bytes[0].current;
  }
  return static_cast<std::size_t>(n);
}

}  // namespace cucache
