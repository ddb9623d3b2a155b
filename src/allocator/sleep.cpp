// Sleep and wake of a sleep domain: the allocator's glue around the sleeper's walk
// (tag_sleeper.hpp / tag_sleeper.cpp; docs/design.md, "Sleep and wake") -- the argument checks,
// every pool lock (lock_all) around the walk, the parts it works with, and the public calls.
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

namespace {

/// cudaErrorNotSupported's number: sleep outside expandable mode.
constexpr int k_not_supported = 801;

std::string bytes_text(std::size_t n) {
  return detail::format_bytes(static_cast<double>(n));
}

/// For the analysis, inside a lambda the sleeper's walk calls under every pool lock (lambdas
/// are analysed on their own).
void every_pool_held() noexcept ASSERT_CAPABILITY(detail::every_pool) {}

std::string who(std::uint32_t domain, const std::string& label) {
  return detail::tag_sleeper::name_of(domain, label);
}

void check_domain(std::uint32_t domain, const char* what) {
  if (domain == 0 || domain > detail::k_max_sleep_domain) {
    throw invalid_argument(fmt::format("cucache: {}: sleep domain {} is not in [1, {}]; nothing "
                                       "changed",
                                       what, domain, detail::k_max_sleep_domain));
  }
}

std::string asleep_block_text(const std::string& name, int device, const void* ptr,
                              const char* what) {
  const bool free = std::string_view(what) == "free";
  return fmt::format(
      "cucache: {}({}) on device {}: the block belongs to {}, which is asleep; wake it before {} "
      "(nothing changed)",
      what, ptr, device, name, free ? "freeing its blocks" : "using its blocks");
}

/// "the domain named twice" refusal, shared by sleep and wake.
template <class Request>
void refuse_duplicates(std::span<const Request> requests, const char* what, int device) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (requests[j].domain == requests[i].domain) {
        throw invalid_argument(fmt::format(
            "cucache: {}: {} on device {} is named twice in the list (entries {} and {}); "
            "nothing changed",
            what, who(requests[i].domain, std::string(requests[i].label)), device, j, i));
      }
    }
  }
}

}  // namespace

void device_allocator::impl::refuse_if_asleep(const stream_pool& p, const void* ptr,
                                              const char* what) const {
  // p locked (annotated): the records are read under a pool lock, and sleep and wake change
  // them under every pool lock.
  if (p.domain == 0 || !sleeper.asleep(p.domain)) return;
  const auto& records = sleeper.records();
  const auto it = records.find(p.domain);
  const std::string name = who(p.domain, it != records.end() ? it->second.label : std::string());
  if (ptr != nullptr) {
    throw invalid_argument(asleep_block_text(name, raw->device(), ptr, what));
  }
  throw invalid_argument(
      fmt::format("cucache: {} on device {}: {} is asleep; wake it before allocating under it "
                  "(nothing changed)",
                  what, raw->device(), name));
}

void device_allocator::impl::refuse_asleep_block(std::uint32_t d, const void* ptr,
                                                 const char* what) {
  std::string label;
  {
    detail::pool_table::all_locked all(pools);
    const auto& records = sleeper.records();
    if (const auto it = records.find(d); it != records.end()) label = it->second.label;
  }
  throw invalid_argument(asleep_block_text(who(d, label), raw->device(), ptr, what));
}

/// The parts the sleeper's walk works with, and the allocation story's steps it needs.
detail::tag_sleeper::parts device_allocator::impl::sleeper_parts() {
  return detail::tag_sleeper::parts{
      pools,
      pager.get(),
      budget,
      *backend,
      graphs,
      raw->device(),
      page_bytes,
      [this](stream_pool& q) {
        detail::pool_table::assert_locked(q);  // the walk holds every pool lock
        sync_pending(q);
      },
      [this] {
        every_pool_held();
        settle_graph_pools();
      },
      [this](const std::vector<detail::segment*>& segs, bool& synchronize) {
        every_pool_held();
        return release_graph_segments(segs, synchronize);
      },
      [this](const std::vector<detail::segment*>& segs) {
        every_pool_held();
        return map_graph_segments(segs);
      }};
}

void device_allocator::impl::sleep(std::span<const device_allocator::sleep_request> requests) {
  if (requests.empty()) {
    throw invalid_argument("cucache: sleep: the list of tags to put to sleep is empty");
  }
  if (!cfg.expandable_segments) {
    throw cuda_error("cucache sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True): in the default mode a "
                                 "block is part of a cudaMalloc'd segment, whose memory cannot be "
                                 "released while its addresses stay reserved; nothing changed",
                                 who(requests[0].domain, std::string(requests[0].label)),
                                 raw->device()));
  }
  for (const auto& r : requests) check_domain(r.domain, "sleep");
  refuse_duplicates(requests, "sleep", raw->device());
  detail::pool_table::all_locked all(pools);
  sleeper.sleep(sleeper_parts(), requests);
}

void device_allocator::impl::wake(std::span<const device_allocator::wake_request> requests) {
  if (requests.empty()) {
    throw invalid_argument("cucache: wake: the list of tags to wake is empty");
  }
  for (const auto& r : requests) check_domain(r.domain, "wake");
  refuse_duplicates(requests, "wake", raw->device());
  detail::pool_table::all_locked all(pools);
  sleeper.wake(sleeper_parts(), requests);
}

std::size_t device_allocator::impl::prepare_sleep(std::uint32_t domain, std::size_t bytes,
                                                  const std::string& label) {
  const std::string name = who(domain, label);
  if (!cfg.expandable_segments) {
    throw cuda_error("cucache prepare_sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True); nothing pinned",
                                 name, raw->device()));
  }
  check_domain(domain, "prepare_sleep");
  std::size_t want = 0;
  {
    detail::pool_table::all_locked all(pools);
    if (sleeper.asleep(domain)) {
      throw invalid_argument(fmt::format(
          "cucache: prepare_sleep: {} on device {} is asleep (its contents already hold a pinned "
          "buffer, kept after wake); nothing changed",
          name, raw->device()));
    }
    // What a kept sleep would copy now: the bytes of the domain's allocated blocks.
    want = std::max(bytes, detail::tag_sleeper::copy_bytes(pools, domain));
    if (const std::size_t have = sleeper.spare_bytes(domain); have >= want && have != 0) return have;
    if (want == 0) return 0;
  }
  // Pinned outside the pool locks: cudaHostAlloc of gigabytes takes seconds (docs/benchmarks.md,
  // "Sleep and wake"), and allocations and frees of every pool go on meanwhile.
  auto* host = static_cast<std::byte*>(backend->host_alloc_pinned(want));
  if (host == nullptr) {
    throw out_of_memory(fmt::format(
        "cucache: prepare_sleep: {} on device {}: cannot pin {} of host memory for the contents "
        "of its next sleep (keep_contents); nothing changed, the sleep would pin it itself",
        name, raw->device(), bytes_text(want)));
  }
  detail::pool_table::all_locked all(pools);
  // Another thread may have prepared (or slept and woken) meanwhile: the larger buffer stays.
  sleeper.keep_spare(*backend, domain, host, want);
  return sleeper.spare_bytes(domain);
}

std::size_t device_allocator::impl::spare_bytes(std::uint32_t domain) {
  detail::pool_table::all_locked all(pools);
  return sleeper.spare_bytes(domain);
}

// --- public shell -------------------------------------------------------------------------------

void device_allocator::set_thread_sleep_domain(std::uint32_t domain) {
  check_domain(domain == 0 ? 1 : domain, "set_thread_sleep_domain");
  detail::t_sleep_domain = domain;
}
std::uint32_t device_allocator::thread_sleep_domain() noexcept {
  return detail::t_sleep_domain;
}
void device_allocator::sleep(std::uint32_t domain, bool keep_contents, std::string_view label,
                             const std::function<void(std::size_t)>& check) {
  const sleep_request one{domain, keep_contents, label, check};
  impl_->sleep(std::span<const sleep_request>(&one, 1));
}
void device_allocator::sleep(std::span<const sleep_request> requests) { impl_->sleep(requests); }
std::size_t device_allocator::prepare_sleep(std::uint32_t domain, std::size_t bytes,
                                            std::string_view label) {
  return impl_->prepare_sleep(domain, bytes, std::string(label));
}
std::size_t device_allocator::sleep_buffer_bytes(std::uint32_t domain) const {
  if (domain == 0 || domain > detail::k_max_sleep_domain) return 0;
  return impl_->spare_bytes(domain);
}
void device_allocator::wake(std::uint32_t domain, std::string_view label) {
  const wake_request one{domain, label};
  impl_->wake(std::span<const wake_request>(&one, 1));
}
void device_allocator::wake(std::span<const wake_request> requests) { impl_->wake(requests); }
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

void device_allocator::impl::free_spare_host_buffers() noexcept {
  sleeper.free_spares(*backend);
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
