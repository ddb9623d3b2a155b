// graph_pools: the allocator's CUDA graph state -- the private pools of graph memory, the routes
// (begin_allocate_to_pool), the captures cucache saw and the blocks held for them -- and the
// rules around it: which part an allocation on a capturing or routed stream goes to, when a
// freed block must be held for a graph, when held blocks and released pools go back. Device
// memory and blocks stay the allocator's: settle() hands back what it releases, and the caller
// frees it (docs/design.md, "Graph capture").
//
// Locking: `mu_` guards every graph pool, the routes, the captures and sync_waiters. It is a
// leaf: never held while another lock is taken (parts are created under the pool list lock taken
// first), and stream filters run under it and must not call the allocator. routes_n_ and
// captures_n_ mirror the sizes for lock-free reads on the allocation and free paths.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "cucache/backend.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache::detail {

/// A block of some pool held pending for a graph pool until its release (and a device
/// synchronization) proves that no replay can touch it.
struct retained_block {
  stream_pool* pool;
  block* b;
};

/// A private pool of graph memory: one stream_pool ("part") per stream that allocated into it, so
/// that a block freed on a stream is reused on that stream only, as everywhere else.
struct graph_pool {
  graph_pool_id id;
  std::uint64_t uses = 0;  // owners not yet released
  bool routed = false;     // a begin_allocate_to_pool route is active
  bool released = false;   // uses reached 0 (or never had any: sync_waiters)
  bool settled = false;    // released, and a device synchronization completed since
  bool no_split = false;   // blocks are never split (MemPool(no_split=True)); set under all locks
  /// The sleep domain (sleepable tag) of the thread that created the pool (t_sleep_domain): its
  /// parts carry it, and in expandable mode their segments sleep and wake with that domain.
  std::uint32_t domain = 0;
  std::unordered_map<std::uint64_t, stream_pool*> parts;  // by stream key
  std::vector<retained_block> retained;
};

/// A stream cucache saw capturing (an allocation on it, or a free that used it).
struct known_capture {
  std::uint64_t capture_id;
  std::uint64_t stream_key;
  graph_pool* pool;
};

struct graph_route {
  graph_pool* pool;
  stream_filter filter;
};

class graph_pools {
 public:
  /// `streams` answers capture states (and names the device in messages); `pools` is where parts
  /// are created.
  graph_pools(device_backend& streams, pool_table& pools);
  graph_pools(const graph_pools&) = delete;
  graph_pools& operator=(const graph_pools&) = delete;

  // --- the public calls (device_allocator's): every pool locked (the ladder reads `released`
  // under the pool locks); state() too, as it reads the parts' statistics. ---
  void begin_route(graph_pool_id pool, stream_filter filter) REQUIRES(every_pool);
  void end_route(graph_pool_id pool) REQUIRES(every_pool);
  void release(graph_pool_id pool) REQUIRES(every_pool);
  [[nodiscard]] graph_pool_info state(graph_pool_id pool) const REQUIRES(every_pool);
  /// One more owner of `pool`, created with one when missing (createOrIncrefPool); a released
  /// pool is revived once settled. Throws invalid_argument as begin_route does.
  void incref(graph_pool_id pool);
  /// The parts of `pool` (none when it does not exist), and whether it exists and is released.
  struct parts_view {
    bool exists = false;
    bool released = false;
    std::vector<stream_pool*> parts;
  };
  [[nodiscard]] parts_view parts_of(graph_pool_id pool) const;
  /// Makes `pool` never split its blocks. Throws invalid_argument for an unknown pool.
  /// Every pool locked: the allocation path reads the flag under a part's lock.
  void set_no_split(graph_pool_id pool) REQUIRES(every_pool);

  // --- the allocation and free paths ---
  /// True while a capture cucache knows of may be underway (a route, or a capture not seen
  /// ended): nothing may synchronize the device.
  [[nodiscard, gnu::always_inline]] bool sync_blocked() const noexcept {
    return routes_n_.load(std::memory_order_acquire) != 0 ||
           captures_n_.load(std::memory_order_acquire) != 0;
  }
  [[nodiscard]] bool any_route() const noexcept {
    return routes_n_.load(std::memory_order_acquire) != 0;
  }
  [[nodiscard]] bool any_capture() const noexcept {
    return captures_n_.load(std::memory_order_acquire) != 0;
  }

  // --- announced captures (docs/design.md, "Announced captures") ---
  /// Whether an allocation may skip its stream's capture query: only in the captures-announced
  /// mode while nothing may be capturing -- no announced capture active, no route, no capture
  /// cucache saw and has not seen end (sync_blocked). One load: the gate word is 0 exactly then.
  [[nodiscard]] bool capture_query_skippable() const noexcept {
    return gate_.load(std::memory_order_acquire) == 0;
  }
  void set_announced(bool on) noexcept {
    if (on) {
      gate_.fetch_and(~k_gate_mode_off, std::memory_order_acq_rel);
    } else {
      gate_.fetch_or(k_gate_mode_off, std::memory_order_acq_rel);
    }
  }
  [[nodiscard]] bool announced() const noexcept {
    return (gate_.load(std::memory_order_acquire) & k_gate_mode_off) == 0;
  }
  void announce_begin() noexcept { gate_.fetch_add(k_gate_one_capture, std::memory_order_acq_rel); }
  /// Throws invalid_argument (changing nothing) when no announced capture is active.
  void announce_end();
  [[nodiscard]] std::uint64_t announced_active() const noexcept {
    return gate_.load(std::memory_order_acquire) / k_gate_one_capture;
  }
  /// The graph pool part an allocation on `stream` goes to (routes first, then its capture), or
  /// nullptr for the stream's own pool. Throws cuda_error 901 for an invalidated capture.
  stream_pool* part_for(stream_handle stream, capture_info cap);
  /// The pool of the capture cucache knows on stream key `key`, or nullptr.
  [[nodiscard]] graph_pool* capture_of(std::uint64_t key) const;
  /// The graph pool for work on capturing stream `stream` (a route's, else the capture's own,
  /// created with one owner), noting the capture.
  graph_pool* capture_pool(stream_handle stream, std::uint64_t key, capture_info cap);
  /// Holds b (pending, of pool p) for g.
  void retain(graph_pool& g, stream_pool& p, block* b) REQUIRES(p.mu);
  /// Holds b (pending, of pool p) until the next device synchronization cucache makes.
  /// Not analysed: it names sync_waiters_ unlocked; retain takes mu_ before it touches it.
  void retain_until_sync(stream_pool& p, block* b) REQUIRES(p.mu) NO_THREAD_SAFETY_ANALYSIS {
    retain(sync_waiters_, p, b);
  }

  /// What settle() gives back: blocks no longer held (each still counted in its pool's
  /// `retained` and its pending_events), and the parts of the released graph pools settled for
  /// the first time, whose wholly free segments go back to the device (memory of a pool freed
  /// after its first settlement stays cached: a later capture may have freed it, and its graph
  /// replay it; empty_cache and the ladder give it back).
  struct settled {
    std::vector<retained_block> blocks;
    std::vector<stream_pool*> parts;
  };
  /// Released graph pools: after one device synchronization (when anything is held, or a pool is
  /// not yet settled) their retained blocks and those waiting for a synchronization come back.
  /// A failed synchronization changes nothing. REQUIRES: !sync_blocked().
  settled settle(device_backend& device) REQUIRES(every_pool);

  /// Throws the cuda_error 900 of `what` (a call that would synchronize the device), naming the
  /// captures and routes that block it.
  [[noreturn]] void throw_capture_blocks(const char* what) const;

  /// Throws std::logic_error naming the first violated invariant: retained blocks are pending
  /// blocks of the pool they name, each pool's `retained` count is right, parts belong to their
  /// graph pool, the lock-free counts equal the lists.
  void check_invariants() const REQUIRES(every_pool);

 private:
  [[nodiscard]] graph_pool* find_locked(graph_pool_id id) const REQUIRES(mu_);
  /// One more owner of `gid` (created with none first), reviving a released pool once settled;
  /// throws invalid_argument, naming the call `what`, for one released and not yet settled.
  graph_pool* add_owner_locked(graph_pool_id gid, const char* what) REQUIRES(mu_);
  graph_pool* capture_pool_locked(stream_handle stream, std::uint64_t key, capture_info cap)
      REQUIRES(mu_);
  [[nodiscard]] graph_pool* known_capture_locked(std::uint64_t key) const REQUIRES(mu_);
  void update_blockers_locked() REQUIRES(mu_);

  device_backend& streams_;
  pool_table& pools_;
  mutable mutex mu_;
  std::map<graph_pool_id, std::unique_ptr<graph_pool>> pools_by_id_ GUARDED_BY(mu_);
  std::vector<graph_route> routes_ GUARDED_BY(mu_);
  std::vector<detail::known_capture> captures_ GUARDED_BY(mu_);
  graph_pool sync_waiters_ GUARDED_BY(mu_);   // blocks waiting for the next device synchronization
  std::atomic<std::uint32_t> routes_n_{0};    // routes_.size()
  std::atomic<std::uint32_t> captures_n_{0};  // captures_.size()
  // The capture gate: bit 0 the captures-announced mode is off, bit 1 sync_blocked() (kept by
  // update_blockers_locked, under mu_), the bits above the count of announced captures active.
  static constexpr std::uint64_t k_gate_mode_off = 1;
  static constexpr std::uint64_t k_gate_blocked = 2;
  static constexpr std::uint64_t k_gate_one_capture = 4;
  std::atomic<std::uint64_t> gate_{k_gate_mode_off};
};

}  // namespace cucache::detail
