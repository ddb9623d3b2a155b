// graph_pools: the graph pools, routes and captures of one allocator (graph_pools.hpp).
#include "allocator/graph_pools.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "allocator/tag_sleeper.hpp"
#include "cucache/errors.hpp"

namespace cucache::detail {

graph_pools::graph_pools(device_backend& streams, pool_table& pools)
    : streams_(streams), pools_(pools) {
  sync_waiters_.released = true;
}

// --- the public calls ---------------------------------------------------------------------------

void graph_pools::begin_route(graph_pool_id gid, stream_filter filter) {
  if (gid == graph_pool_id{}) {
    throw invalid_argument("cucache::begin_allocate_to_pool: pool id (0, 0) names no pool");
  }
  if (!filter) throw invalid_argument("cucache::begin_allocate_to_pool: the filter is empty");
  detail::lock_guard lock(mu_);
  graph_pool* g = find_locked(gid);
  if (g != nullptr && g->routed) {
    throw invalid_argument(
        fmt::format("cucache::begin_allocate_to_pool: graph pool ({:#x}, {:#x}) is routed already",
                    gid.first, gid.second));
  }
  routes_.reserve(routes_.size() + 1);
  g = add_owner_locked(gid, "begin_allocate_to_pool");
  g->routed = true;
  routes_.push_back({g, std::move(filter)});
  update_blockers_locked();
}

void graph_pools::incref(graph_pool_id gid) {
  if (gid == graph_pool_id{}) {
    throw invalid_argument("cucache::create_or_incref_graph_pool: pool id (0, 0) names no pool");
  }
  detail::lock_guard lock(mu_);
  add_owner_locked(gid, "create_or_incref_graph_pool");
}

graph_pool* graph_pools::add_owner_locked(graph_pool_id gid, const char* what) {
  graph_pool* g = find_locked(gid);
  if (g != nullptr && g->released && !g->settled) {
    throw invalid_argument(fmt::format(
        "cucache::{}: graph pool ({:#x}, {:#x}) was released and a replay of its last graph may "
        "still run (no device synchronization since: a capture is underway)",
        what, gid.first, gid.second));
  }
  if (g == nullptr) {
    auto owned = std::make_unique<graph_pool>();
    owned->id = gid;
    owned->domain = t_sleep_domain;  // the creating thread's sleepable tag, if any
    g = owned.get();
    pools_by_id_.emplace(gid, std::move(owned));
  }
  ++g->uses;
  g->released = false;
  g->settled = false;
  return g;
}

graph_pools::parts_view graph_pools::parts_of(graph_pool_id gid) const {
  detail::lock_guard lock(mu_);
  parts_view out;
  const graph_pool* g = find_locked(gid);
  if (g == nullptr) return out;
  out.exists = true;
  out.released = g->released;
  for (auto [key, part] : g->parts) out.parts.push_back(part);
  return out;
}

void graph_pools::set_no_split(graph_pool_id gid) {
  detail::lock_guard lock(mu_);
  graph_pool* g = find_locked(gid);
  if (g == nullptr) {
    throw invalid_argument(fmt::format(
        "cucache::set_graph_pool_no_split: graph pool ({:#x}, {:#x}) does not exist (create it "
        "first: create_or_incref_graph_pool)",
        gid.first, gid.second));
  }
  g->no_split = true;
}

void graph_pools::end_route(graph_pool_id gid) {
  detail::lock_guard lock(mu_);
  graph_pool* g = find_locked(gid);
  bool found = false;
  if (g != nullptr) {
    found = std::erase_if(routes_, [&](const auto& r) { return r.pool == g; }) != 0;
    g->routed = false;
    found = std::erase_if(captures_, [&](const auto& c) { return c.pool == g; }) != 0 || found;
    update_blockers_locked();
  }
  if (!found) {
    throw invalid_argument(
        fmt::format("cucache::end_allocate_to_pool: nothing allocates to graph pool ({:#x}, {:#x})",
                    gid.first, gid.second));
  }
}

void graph_pools::release(graph_pool_id gid) {
  detail::lock_guard lock(mu_);
  graph_pool* g = find_locked(gid);
  if (g == nullptr || g->uses == 0) {
    throw invalid_argument(fmt::format(
        "cucache::release_graph_pool: graph pool ({:#x}, {:#x}) {}", gid.first, gid.second,
        g == nullptr ? "does not exist" : "has no owner left (released already)"));
  }
  if (g->routed && g->uses == 1) {
    // (Another owner may go while the route lasts; the last cannot.)
    throw invalid_argument(
        fmt::format("cucache::release_graph_pool: graph pool ({:#x}, {:#x}) is still routed "
                    "and this is its last owner (end_allocate_to_pool first)",
                    gid.first, gid.second));
  }
  if (--g->uses == 0) {
    g->released = true;
    g->settled = false;
    // A graph that is released has been captured: its capture has ended.
    std::erase_if(captures_, [&](const auto& c) { return c.pool == g; });
    update_blockers_locked();
  }
}

graph_pool_info graph_pools::state(graph_pool_id gid) const {
  detail::lock_guard lock(mu_);
  graph_pool_info info;
  const graph_pool* g = find_locked(gid);
  if (g == nullptr) return info;
  info.exists = true;
  info.uses = g->uses;
  info.routed = g->routed;
  info.released = g->released;
  info.retained_blocks = g->retained.size();
  for (auto [key, part] : g->parts) {
    detail::pool_table::assert_locked(*part);
    info.reserved_bytes += static_cast<std::size_t>(part->stats.reserved_bytes[0].current);
    info.allocated_bytes += static_cast<std::size_t>(part->stats.allocated_bytes[0].current);
  }
  return info;
}

// --- captures and routes ------------------------------------------------------------------------

graph_pool* graph_pools::find_locked(graph_pool_id gid) const {
  auto it = pools_by_id_.find(gid);
  return it == pools_by_id_.end() ? nullptr : it->second.get();
}

void graph_pools::update_blockers_locked() {
  routes_n_.store(static_cast<std::uint32_t>(routes_.size()), std::memory_order_release);
  captures_n_.store(static_cast<std::uint32_t>(captures_.size()), std::memory_order_release);
  if (routes_.empty() && captures_.empty()) {
    gate_.fetch_and(~k_gate_blocked, std::memory_order_acq_rel);
  } else {
    gate_.fetch_or(k_gate_blocked, std::memory_order_acq_rel);
  }
}

graph_pool* graph_pools::known_capture_locked(std::uint64_t key) const {
  for (const known_capture& c : captures_) {
    if (c.stream_key == key) return c.pool;
  }
  return nullptr;
}

graph_pool* graph_pools::capture_of(std::uint64_t key) const {
  detail::lock_guard lock(mu_);
  return known_capture_locked(key);
}

graph_pool* graph_pools::capture_pool(stream_handle stream, std::uint64_t key, capture_info cap) {
  detail::lock_guard lock(mu_);
  return capture_pool_locked(stream, key, cap);
}

graph_pool* graph_pools::capture_pool_locked(stream_handle stream, std::uint64_t key,
                                             capture_info cap) {
  graph_pool* g = nullptr;
  for (graph_route& r : routes_) {
    if (r.filter(stream)) {
      g = r.pool;
      break;
    }
  }
  if (g == nullptr) {
    const graph_pool_id gid = graph_pool_id::of_capture(cap.id);
    g = find_locked(gid);
    if (g == nullptr) {
      auto owned = std::make_unique<graph_pool>();
      owned->id = gid;
      owned->domain = t_sleep_domain;  // the capturing thread's sleepable tag, if any
      owned->uses = 1;  // the capture's graph; release_graph_pool(of_capture(id)) drops it
      g = owned.get();
      pools_by_id_.emplace(gid, std::move(owned));
    }
  }
  // One entry per stream: an entry of an earlier capture on this stream has ended.
  bool noted = false;
  for (known_capture& c : captures_) {
    if (c.stream_key == key) {
      c.capture_id = cap.id;
      c.pool = g;
      noted = true;
    }
  }
  if (!noted) captures_.push_back({cap.id, key, g});
  update_blockers_locked();
  return g;
}

void graph_pools::announce_end() {
  std::uint64_t g = gate_.load(std::memory_order_acquire);
  do {
    if (g < k_gate_one_capture) {
      throw invalid_argument(fmt::format(
          "cucache::announce_capture_end: device {} has no announced capture active (every end "
          "must follow its own announce_capture_begin)",
          streams_.device()));
    }
  } while (!gate_.compare_exchange_weak(g, g - k_gate_one_capture, std::memory_order_acq_rel));
}

stream_pool* graph_pools::part_for(stream_handle stream, capture_info cap) {
  if (cap.state == capture_state::invalidated) {
    throw cuda_error(
        "cucache::allocate", 901,  // cudaErrorStreamCaptureInvalidated
        fmt::format("stream {} is in a CUDA graph capture that an illegal call invalidated; the "
                    "graph can never run, and cucache allocates nothing for it (end the capture)",
                    fmt::ptr(stream)));
  }
  // A capturing stream's part is keyed by its capture key (its id cannot be asked); a stream
  // routed to a graph pool outside a capture by its id, as everywhere else.
  const std::uint64_t ckey = pool_table::capture_key(stream);
  const std::uint64_t key = cap.state == capture_state::active ? ckey : pools_.stream_key(stream);
  graph_pool* g = nullptr;
  {
    detail::lock_guard lock(mu_);
    if (cap.state == capture_state::active) {
      g = capture_pool_locked(stream, ckey, cap);
    } else {
      for (graph_route& r : routes_) {
        if (r.filter(stream)) {
          g = r.pool;
          break;
        }
      }
      // Not capturing now: a capture cucache noted on this stream has ended.
      if (std::erase_if(captures_, [&](const auto& c) { return c.stream_key == ckey; }) != 0) {
        update_blockers_locked();
      }
    }
    if (g == nullptr) return nullptr;
    if (g->released) {
      throw invalid_argument(fmt::format(
          "cucache: graph pool ({:#x}, {:#x}) on device {} was released while a capture still "
          "allocates from it",
          g->id.first, g->id.second, streams_.device()));
    }
    if (auto it = g->parts.find(key); it != g->parts.end()) return it->second;
  }
  detail::lock_guard list(pools_.list_mutex());
  detail::lock_guard lock(mu_);
  if (auto it = g->parts.find(key); it != g->parts.end()) return it->second;
  stream_pool& part = pools_.new_pool(stream, key, g, g->domain);
  g->parts.emplace(key, &part);
  return &part;
}

void graph_pools::retain(graph_pool& g, stream_pool& p, block* b) {
  {
    detail::lock_guard lock(mu_);
    g.retained.push_back({&p, b});
  }
  ++b->uses->pending_events;
  ++p.retained;
}

graph_pools::settled graph_pools::settle(device_backend& device) {
  std::vector<graph_pool*> released;
  bool wait = false;
  {
    detail::lock_guard lock(mu_);
    for (auto& [gid, g] : pools_by_id_) {
      if (!g->released) continue;
      released.push_back(g.get());
      wait = wait || !g->settled || !g->retained.empty();
    }
    wait = wait || !sync_waiters_.retained.empty();
  }
  settled out;
  if (released.empty() && !wait) return out;
  // The last replay of a released graph may still run, on any stream: only a device-wide
  // synchronization proves that its memory is idle. A failure changes nothing.
  if (wait) device.device_synchronize();
  {
    detail::lock_guard lock(mu_);
    out.blocks.swap(sync_waiters_.retained);
    for (graph_pool* g : released) {
      out.blocks.insert(out.blocks.end(), g->retained.begin(), g->retained.end());
      g->retained.clear();
      // Only at its first settlement does a pool give its free segments back: what was wholly
      // free then had no live graph left to replay it. A block freed after that may have been
      // freed inside a later capture (PyTorch's test_graph_capture_reset_recapture: a graph's
      // output, written and freed by the next graph), whose replays still use it: such memory
      // stays cached in the released pool until empty_cache or the out-of-memory ladder, as in
      // PyTorch, which frees a released pool's memory only there.
      if (!g->settled) {
        for (auto [key, part] : g->parts) out.parts.push_back(part);
      }
      g->settled = true;
    }
  }
  return out;
}

void graph_pools::throw_capture_blocks(const char* what) const {
  std::string who;
  {
    detail::lock_guard lock(mu_);
    for (const known_capture& c : captures_) {
      who += fmt::format("{}capture {} (stream id {:#x})", who.empty() ? "" : ", ", c.capture_id,
                         c.stream_key);
    }
    for (const graph_route& r : routes_) {
      who += fmt::format("{}the route to graph pool ({:#x}, {:#x})", who.empty() ? "" : ", ",
                         r.pool->id.first, r.pool->id.second);
    }
  }
  throw cuda_error(
      fmt::format("cucache::{}", what), 900,  // cudaErrorStreamCaptureUnsupported
      fmt::format("device {}: a CUDA graph capture may be underway ({}); returning memory to the "
                  "device synchronizes it, which is illegal during a capture. End the capture "
                  "and tell cucache (end_allocate_to_pool, release_graph_pool), or allocate on "
                  "the stream again once its capture has ended",
                  streams_.device(), who));
}

// --- invariants ---------------------------------------------------------------------------------

void graph_pools::check_invariants() const {
  const auto violated = [](const std::string& what) {
    throw std::logic_error("cucache invariant violated: " + what);
  };
  detail::lock_guard lock(mu_);
  std::map<const stream_pool*, std::size_t> retained;
  auto check_retained = [&](const graph_pool& g) {
    for (const retained_block& r : g.retained) {
      if (r.b->state != block_state::pending || r.b->seg->owner != r.pool) {
        violated(
            fmt::format("graph pool ({:#x}, {:#x}) retains block {:#x}, which is not a "
                        "pending block of pool {}",
                        g.id.first, g.id.second, r.b->addr, r.pool->index));
      }
      ++retained[r.pool];
    }
  };
  check_retained(sync_waiters_);
  for (const auto& [gid, g] : pools_by_id_) {
    check_retained(*g);
    for (const auto& [key, part] : g->parts) {
      if (part->graph != g.get() || part->key != key) {
        violated(fmt::format("graph pool ({:#x}, {:#x}): part {} is not its own", gid.first,
                             gid.second, part->index));
      }
    }
  }
  for (const auto& pp : pools_) {
    detail::pool_table::assert_locked(*pp);
    const auto it = retained.find(pp.get());
    const std::size_t n = it == retained.end() ? 0 : it->second;
    if (n != pp->retained) {
      violated(
          fmt::format("pool {}: {} retentions listed, count says {}", pp->index, n, pp->retained));
    }
  }
  if (routes_n_.load() != routes_.size() || captures_n_.load() != captures_.size()) {
    violated("graph capture: blocker counts disagree with the routes and captures");
  }
  // The capture gate's blocked bit is what skipping the capture query rests on.
  const bool blocked = (gate_.load() & k_gate_blocked) != 0;
  if (blocked != (!routes_.empty() || !captures_.empty())) {
    violated(fmt::format("graph capture: the capture gate says {}blocked, with {} routes and {} "
                         "captures known",
                         blocked ? "" : "not ", routes_.size(), captures_.size()));
  }
}

}  // namespace cucache::detail
