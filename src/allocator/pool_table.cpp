// pool_table: pool lookup (the thread cache's miss), creation and locking (pool_table.hpp).
#include "allocator/pool_table.hpp"

#include <atomic>

namespace cucache::detail {

namespace {
std::atomic<std::uint64_t> g_table_ids{1};
}  // namespace

pool_table::pool_table(device_backend& streams)
    : streams_(streams), id_(g_table_ids.fetch_add(1)) {}

stream_pool& pool_table::pool_for_key(stream_handle stream, std::uint64_t stream_key,
                                      std::uint32_t domain) {
  // The pool's own `key` stays the stream's (names_pool_stream compares it); the map and the
  // thread's cache use the domain's key.
  const std::uint64_t key = domain_key(stream_key, domain);
  pool_cache_entry& c = t_pool_cache;
  stream_pool* p = nullptr;
  {
    std::shared_lock lock(mu_);
    auto it = pool_by_stream_.find(key);
    if (it != pool_by_stream_.end()) p = it->second;
  }
  if (p == nullptr) {
    std::unique_lock lock(mu_);
    auto it = pool_by_stream_.find(key);
    if (it != pool_by_stream_.end()) {
      p = it->second;
    } else {
      pools_.push_back(
          std::make_unique<stream_pool>(stream, stream_key, pools_.size(), nullptr, domain));
      p = pools_.back().get();
      pool_by_stream_.emplace(key, p);
    }
  }
  c = pool_cache_entry{id_, key, p};
  return *p;
}

stream_pool& pool_table::new_pool(stream_handle stream, std::uint64_t key, graph_pool* g) {
  // REQUIRES: mu_ held exclusively.
  pools_.push_back(std::make_unique<stream_pool>(stream, key, pools_.size(), g));
  return *pools_.back();
}

pool_table::all_locked pool_table::lock_all() const {
  all_locked a{std::shared_lock(mu_), {}};
  a.locks.reserve(pools_.size());
  for (const auto& p : pools_) a.locks.emplace_back(p->mu);
  return a;
}

}  // namespace cucache::detail
