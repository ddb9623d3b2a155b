// pool_table: pool lookup (the thread cache's miss), creation and locking (pool_table.hpp).
#include "allocator/pool_table.hpp"

#include <atomic>
#include <unordered_set>

#include <fmt/format.h>

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
    detail::shared_lock lock(mu_);
    auto it = pool_by_stream_.find(key);
    if (it != pool_by_stream_.end()) p = it->second;
  }
  if (p == nullptr) {
    detail::unique_lock lock(mu_);
    auto it = pool_by_stream_.find(key);
    if (it != pool_by_stream_.end()) {
      p = it->second;
    } else {
      p = adopt_locked(stream, stream_key, domain);
      if (p == nullptr) {
        pools_.push_back(
            std::make_unique<stream_pool>(stream, stream_key, pools_.size(), nullptr, domain));
        p = pools_.back().get();
      }
      pool_by_stream_.emplace(key, p);
    }
  }
  c = pool_cache_entry{id_, key, p};
  return *p;
}

void pool_table::queue_quiet(stream_pool& p) noexcept {
  if (p.retirement.queued()) return;
  detail::lock_guard lock(quiet_mu_);
  try {
    (p.holds_no_memory() ? empty_ : quiet_).push_back(&p);
    p.retirement.set_queued(true);
  } catch (...) {
  }
}

void pool_table::requeue(std::deque<stream_pool*>& q, stream_pool* d) noexcept {
  detail::lock_guard lock(quiet_mu_);
  try {
    q.push_back(d);
  } catch (...) {
    // Out of memory: d stays marked queued and is never looked at again -- kept, not lost (the
    // device-wide paths still see it), only never handed to another stream.
  }
}

pool_table::verdict pool_table::judge(stream_pool& d) const {
  // Retired when no block of d is live, pending or held, and nothing d's stream did with its
  // blocks can still run: either d holds no device memory (nothing of it is handed over; its
  // virtual ranges were emptied behind a device synchronization), or the quiet event, recorded
  // on d's stream after its last free (tick unchanged since), has completed. Work on other
  // streams is covered by the pending frees' own events (none are left).
  if (!d.quiet()) return verdict::stale;
  if (d.holds_no_memory()) return verdict::retired;
  if (!d.retirement.event_proves(d.tick) || events_ == nullptr) {
    return verdict::stale;
  }
  try {
    return events_->event_query(d.retirement.quiet_event()) ? verdict::retired : verdict::wait;
  } catch (...) {
    return verdict::stale;  // no proof: kept by its stream's key until a device-wide path
  }
}

stream_pool* pool_table::adopt_locked(stream_handle stream, std::uint64_t key,
                                      std::uint32_t domain) {
  // Pools with cached memory first (the new stream gets their cache),
  // then pools without. In each queue the oldest candidates first; one whose proof is not there
  // yet goes to the back, one that is no longer quiet (or whose event a later activity made
  // stale) leaves the queue until it is queued again.
  for (int probe = 0; probe < 2 * k_adopt_probes; ++probe) {
    std::deque<stream_pool*>& q = probe < k_adopt_probes ? quiet_ : empty_;
    stream_pool* d = nullptr;
    {
      detail::lock_guard lock(quiet_mu_);
      if (q.empty()) {
        if (probe < k_adopt_probes) {
          probe = k_adopt_probes - 1;  // on to the pools without memory
          continue;
        }
        return nullptr;
      }
      d = q.front();
      q.pop_front();
    }
    // A pool of another sleep domain serves only that domain: its pages are that tag's alone.
    if (d->domain != domain) {
      requeue(q, d);
      continue;
    }
    if (!d->mu.try_lock()) {  // never waits: d.mu comes after mu_ anyway
      requeue(q, d);  // d stays marked queued
      continue;
    }
    pool_lock lk(d->mu, std::adopt_lock);
    const verdict v = judge(*d);
    if (v == verdict::wait) {
      lk.unlock();
      requeue(q, d);
      continue;
    }
    d->retirement.set_queued(false);
    if (v == verdict::stale) continue;
    // Retired: d serves the new stream from here, its free memory with it. Threads whose cache
    // still names d under the old key find the key changed under d's lock (lock_pool_for).
    if (auto it = pool_by_stream_.find(domain_key(d->key, d->domain));
        it != pool_by_stream_.end() && it->second == d) {
      pool_by_stream_.erase(it);
    }
    d->key = key;  // the stream's key; the map names d by domain_key(key, domain)
    d->stream = stream;
    d->retirement.restart();
    adoptions_.fetch_add(1, std::memory_order_relaxed);
    return d;
  }
  return nullptr;
}

std::string pool_table::check_map() const {
  std::unordered_set<const stream_pool*> named;
  for (const auto& [key, p] : pool_by_stream_) {
    if (domain_key(p->key, p->domain) != key) {
      return fmt::format("the pool table maps stream key {:#x} to pool {}, whose key is {:#x}", key,
                         p->index, p->key);
    }
    if (p->graph != nullptr) {
      return fmt::format("the pool table maps stream key {:#x} to a graph pool's part", key);
    }
    if (!named.insert(p).second) {
      return fmt::format("the pool table maps two stream keys to pool {}", p->index);
    }
  }
  return {};
}

stream_pool& pool_table::new_pool(stream_handle stream, std::uint64_t key, graph_pool* g,
                                  std::uint32_t domain) {
  pools_.push_back(std::make_unique<stream_pool>(stream, key, pools_.size(), g, domain));
  return *pools_.back();
}

pool_table::all_locked::all_locked(const pool_table& t, purpose why) : t_(t), why_(why) {
  lock();
}

pool_table::all_locked::~all_locked() {
  if (held_) unlock();
}

void pool_table::all_locked::lock() {
  t_.mu_.lock_shared();
  try {
    locked_.reserve(t_.pools_.size());
  } catch (...) {
    t_.mu_.unlock_shared();
    throw;
  }
  for (const auto& p : t_.pools_) {
    p->mu.lock();
    locked_.push_back(&p->mu);
  }
  held_ = true;
  if (why_ == purpose::change) t_.mark_all_stale();
}

void pool_table::all_locked::unlock() {
  for (auto it = locked_.rbegin(); it != locked_.rend(); ++it) (*it)->unlock();
  locked_.clear();
  t_.mu_.unlock_shared();
  held_ = false;
}

}  // namespace cucache::detail
