// pool_table: the stream pools of one allocator -- every pool in creation order, the map from a
// stream's key to its pool, the thread-local one-entry cache in front of that map -- and the
// keys streams are known by. Pools are created here (a stream's own pool on its first request, a
// graph pool's part by graph_pools) and their objects are never destroyed before the allocator:
// a stream's pool that is proven retired -- quiet (stream_pool::quiet) and either holding no
// device memory or with a completed quiet event recorded after its last free -- is handed,
// with its cached memory, to the next stream that needs a new pool of its sleep domain
// (pool_for_key). So the number of pools is the number of (stream, domain) pairs with blocks or
// unproven cache at once, not the number ever seen (docs/design.md, "What a stream costs").
//
// Locking: `mu_` guards the list and the map (shared to look up or walk, exclusive to add or to
// hand a pool to another stream). Pools are locked in creation order (`index`); lock_all takes
// the list shared and every pool. A pool's contents are under its own mutex (stream_pool::mu),
// never under mu_. `quiet_mu_` (a leaf) guards the queue of retirement candidates.
// For clang's thread-safety analysis, "every pool locked" is the capability `every_pool`
// (pool_mutex.hpp), held
// while an all_locked lives (docs/decisions/0018-thread-safety-annotations.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator/hot.hpp"
#include "allocator/pool_mutex.hpp"
#include "allocator/stream_pool.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

/// The pool key of the legacy default stream (nullptr or cudaStreamLegacy: is_legacy_stream),
/// which is never destroyed nor captured: no backend call for it. Real and simulated stream ids
/// never take this value.
inline constexpr std::uint64_t k_legacy_stream_key = ~std::uint64_t{0};

/// The thread's last pool lookup: the table that made it, the stream key, the pool.
struct pool_cache_entry {
  std::uint64_t owner = 0;
  std::uint64_t key = 0;  // the stream's id: a reused handle value never hits a dead stream's pool
  stream_pool* pool = nullptr;
};
inline thread_local pool_cache_entry t_pool_cache;

class pool_table {
 public:
  /// `streams` answers stream ids and capture states (the backend as given: no capture check).
  explicit pool_table(device_backend& streams);
  pool_table(const pool_table&) = delete;
  pool_table& operator=(const pool_table&) = delete;

  // --- keys -----------------------------------------------------------------------------------
  /// The key of `stream`'s pool: its stream id.
  [[nodiscard]] std::uint64_t stream_key(stream_handle stream) const {
    return is_legacy_stream(stream) ? k_legacy_stream_key : streams_.stream_id(stream);
  }
  /// The key of a stream that is being captured. cudaStreamGetId is refused on a capturing stream
  /// in every capture mode, relaxed included, and the refusal invalidates the capture (seen on the
  /// H200), so a capturing stream is keyed by its handle, tagged so that it never equals an id
  /// (ids are small counters). A stream cannot be destroyed while it is being captured, so the
  /// handle names one stream for as long as the capture lasts; graph pools and the list of known
  /// captures are the only places such keys go.
  [[nodiscard]] static std::uint64_t capture_key(stream_handle stream) noexcept {
    return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(stream)) | k_capture_key_tag;
  }
  static constexpr std::uint64_t k_capture_key_tag = std::uint64_t{1} << 63;
  /// The key of any stream: its capture key while it is being captured, its id otherwise.
  [[nodiscard]] std::uint64_t any_stream_key(stream_handle stream) const {
    if (is_legacy_stream(stream)) return k_legacy_stream_key;
    const stream_identity who = streams_.identify(stream);
    return who.capture.state != capture_state::none ? capture_key(stream) : who.id;
  }
  /// True when `stream`, named by the caller, is the stream p serves (handles equal, and for the
  /// per-thread handle the ids too). A destroyed stream's pool is never confused with a live one
  /// on the allocation path (keys differ); here equal handles of different streams can only mean
  /// that p's stream was destroyed, and p's blocks are then reachable only through paths that
  /// synchronize the device, so treating them as p's own stream is safe.
  /// The legacy stream's two handles (nullptr, cudaStreamLegacy) name one stream.
  [[nodiscard]] CUCACHE_HOT bool names_pool_stream(const stream_pool& p,
                                                 stream_handle stream) const {
    if (stream != p.stream) [[unlikely]]
      return is_legacy_stream(stream) && is_legacy_stream(p.stream);
    return stream != per_thread_stream() || any_stream_key(stream) == p.key;
  }

  // --- lookup and creation --------------------------------------------------------------------
  /// The pool of `stream`, created on first use (thread-local one-entry cache in front of the
  /// map).
  CUCACHE_HOT stream_pool& pool_for(stream_handle stream) {
    return pool_for(stream, stream_key(stream));
  }
  /// pool_for when the caller already knows the stream's key (stream_key): the allocation path
  /// asks the backend once for a stream's capture and id (device_backend::identify). `domain`
  /// (tag_sleeper.hpp): 0 for the stream's own pool, else the pool of that sleep domain on the
  /// stream -- its pool key is the stream key with the domain in bits 48..61 (domain_key), which
  /// no stream id, capture key or the legacy key has.
  CUCACHE_HOT stream_pool& pool_for(stream_handle stream, std::uint64_t key,
                                    std::uint32_t domain = 0) {
    // By stream id, not handle: once the program destroys a stream, the runtime hands its handle
    // value to the next stream it creates, while work queued on the dead one may still run. A
    // pool keyed by the value would give the new stream blocks whose last use is that work.
    const std::uint64_t k = domain_key(key, domain);
    const pool_cache_entry& c = t_pool_cache;
    if (c.owner == id_ && c.key == k) [[likely]]
      return *c.pool;
    return pool_for_key(stream, key, domain);
  }
  /// The map key of the pool of sleep domain `domain` (< 2^14) on the stream of key `key`.
  [[nodiscard]] static constexpr std::uint64_t domain_key(std::uint64_t key,
                                                          std::uint32_t domain) noexcept {
    return key ^ (static_cast<std::uint64_t>(domain) << 48);
  }
  /// pool_for's miss of the thread's cache: out of line, so that the hit stays small. A new
  /// pool is a retired one of the same sleep domain when a candidate is proven retired (at most
  /// k_adopt_probes looked at), else a new object.
  stream_pool& pool_for_key(stream_handle stream, std::uint64_t key, std::uint32_t domain = 0);
  /// The pool of `stream`, locked. A pool found through the thread's cache may have been handed
  /// to another stream since (its key then differs, read under its lock): looked up again.
  /// The analysis cannot follow the lock out of the call: the caller asserts it
  /// (`lp.pool->mu.assert_held()`). `keeping_held`: locked by pool_mutex::lock_keeping_held, for
  /// the allocation fast path, which then takes back or merges the pool's held block itself.
  struct locked_pool {
    stream_pool* pool;
    pool_lock lock;
  };
  [[nodiscard]] locked_pool lock_pool_for(stream_handle stream) {
    return lock_pool_for(stream, stream_key(stream));
  }
  // Not analysed: the lock moves from pool to pool at run time (the analysis names one mutex).
  [[nodiscard]] locked_pool lock_pool_for(stream_handle stream, std::uint64_t key,
                                          std::uint32_t domain = 0,
                                          bool keeping_held = false) NO_THREAD_SAFETY_ANALYSIS {
    // (No helper lambda: the analysis would check it on its own and find it returning locked.)
    stream_pool* p = &pool_for(stream, key, domain);
    p->mu.lock(keeping_held);
    pool_lock lk(p->mu, std::adopt_lock);
    while (p->key != key) [[unlikely]] {
      lk.unlock();
      p = &pool_for_key(stream, key, domain);
      p->mu.lock(keeping_held);
      lk = pool_lock(p->mu, std::adopt_lock);
    }
    note_change(*p);
    return {p, std::move(lk)};
  }

  // --- statistics (stats_ledger.hpp) ----------------------------------------------------------
  /// p is locked for a change: its summary is stale, queued once for the ledger. Every path that
  /// locks a pool to change it calls this (lock_pool_for, the free, a graph pool's part, the
  /// pager's try_lock of a peer, a re-lock after unlocked_midway; lock_all marks every pool).
  CUCACHE_HOT void note_change(stream_pool& p) noexcept REQUIRES(p.mu) {
    if (!p.ledger.stale()) [[unlikely]]
      stale_.mark(p);
  }
  /// The pools queued as stale since the last call (each once), and whether lock_all marked
  /// every pool stale meanwhile. A pool summarized again by someone else since it was queued is
  /// still listed (summarizing it once more is harmless). `changes`: the count of marks
  /// (changed_since) when the queue was taken.
  using stale_pools = pool_ledger::stale_queue::taken;
  [[nodiscard]] stale_pools take_stale() const { return stale_.take(); }
  /// lock_all ran since the last take_stale (every summary may be stale).
  [[nodiscard]] bool all_stale() const noexcept { return stale_.all_marked(); }
  /// Whether a pool was marked stale (queue_stale: a pool whose summary was current was locked
  /// for a change) or lock_all ran since take_stale returned `changes`. The count is kept under
  /// the queue's own lock, on the paths that take it already: nothing is added to a cache hit,
  /// whose pool is stale already (docs/design.md, "Statistics under concurrent readers").
  [[nodiscard]] bool changed_since(std::uint64_t changes) const {
    return stale_.changed_since(changes);
  }
  /// Marks every pool stale, as lock_all does: for a refresh that failed part way (the pools it
  /// had taken from the queue must not be forgotten).
  void mark_all_stale() const noexcept { stale_.mark_all(); }

  // --- retirement ------------------------------------------------------------------------------
  // A pool's own retirement state (stream_pool::retirement, pool_retirement) is stepped by the
  // allocator directly under the pool's mutex (count_quiet_free, begin_record,
  // unlocked_allocation_began/ended); the table's steps are those that reach its queues and
  // adoption: queue_quiet, quiet_recorded, pool_for_key.
  /// Where quiet events are queried (the capture-safe backend); set once by the allocator before
  /// any pool is queued. Without it only pools that hold no device memory are retired.
  void set_event_backend(device_backend* events) noexcept { events_ = events; }
  /// Queues p (once) as a candidate for retirement: it went quiet with a quiet event recorded,
  /// or holds no device memory. Never throws (a pool not queued is only kept longer).
  void queue_quiet(stream_pool& p) noexcept REQUIRES(p.mu);
  /// p's quiet event was recorded with p quiet: proof once it completes while p's tick stays,
  /// and p is queued as a candidate.
  void quiet_recorded(stream_pool& p) noexcept REQUIRES(p.mu) {
    p.retirement.recorded(p.tick);
    queue_quiet(p);
  }
  /// Candidates looked at per new pool in each queue (each: one try_lock, at most one event
  /// query).
  static constexpr int k_adopt_probes = 4;
  /// The map and the pools agree: every stream pool the map names has that key, is no graph
  /// pool's part, and is named once. Returns what is wrong, or an empty string.
  [[nodiscard]] std::string check_map() const REQUIRES(every_pool) REQUIRES_SHARED(mu_);
  /// Pools handed from a retired stream to a new one, since the table was made (for tests).
  [[nodiscard]] std::uint64_t adoptions() const noexcept {
    return adoptions_.load(std::memory_order_relaxed);
  }
  /// The list lock, exclusive: for new_pool (`lock_guard list(table.list_mutex())`).
  /// A new pool outside the map (a graph pool's part), of the graph pool's sleep domain.
  stream_pool& new_pool(stream_handle stream, std::uint64_t key, graph_pool* g,
                        std::uint32_t domain) REQUIRES(mu_);

  // --- device-wide work -----------------------------------------------------------------------
  /// Why every pool is locked: `change` (device-wide work that may change any pool) marks every
  /// pool's summary stale; `read` (the invariant check) marks nothing.
  enum class purpose : bool { change, read };
  /// Every pool locked in index order, the list held shared, while it lives: the capability
  /// `every_pool` for the analysis. unlock() and lock() let a caller wait without them. Not
  /// analysed inside (it takes a run-time list of locks); its annotations say what it holds.
  class SCOPED_CAPABILITY all_locked {
   public:
    explicit all_locked(const pool_table& t, purpose why = purpose::change) ACQUIRE(every_pool)
        ACQUIRE_SHARED(t.mu_) NO_THREAD_SAFETY_ANALYSIS;
    ~all_locked() RELEASE() NO_THREAD_SAFETY_ANALYSIS;
    all_locked(const all_locked&) = delete;
    all_locked& operator=(const all_locked&) = delete;
    void lock() ACQUIRE() NO_THREAD_SAFETY_ANALYSIS;
    void unlock() RELEASE() NO_THREAD_SAFETY_ANALYSIS;

   private:
    const pool_table& t_;
    const purpose why_;
    bool held_ = false;
    std::vector<pool_mutex*> locked_;
  };
  /// Pool p is locked: for a walk over the pools under every_pool.
  static void assert_locked([[maybe_unused]] const stream_pool& p) noexcept
      ASSERT_CAPABILITY(p.mu) {}

  /// Every pool in creation order. REQUIRES: the list held (all_locked, or shared). Not
  /// annotated: a range-for names its range by a variable of its own, which the analysis cannot
  /// match to mu_.
  [[nodiscard]] auto begin() const noexcept NO_THREAD_SAFETY_ANALYSIS { return pools_.begin(); }
  [[nodiscard]] auto end() const noexcept NO_THREAD_SAFETY_ANALYSIS { return pools_.end(); }
  [[nodiscard]] std::size_t size() const noexcept NO_THREAD_SAFETY_ANALYSIS {
    return pools_.size();
  }
  /// For walks that must not wait (the pager's, under try_lock), and for new_pool: the list
  /// lock and the list.
  [[nodiscard]] shared_mutex& list_mutex() const noexcept RETURN_CAPABILITY(mu_) { return mu_; }
  [[nodiscard]] const std::vector<std::unique_ptr<stream_pool>>& list() const noexcept
      NO_THREAD_SAFETY_ANALYSIS {  // as begin(): the callers' locks are conditional or try_locks
    return pools_;
  }

 private:
  enum class verdict { retired, wait, stale };
  /// Whether candidate d (locked) may be handed to another stream now.
  verdict judge(stream_pool& d) const REQUIRES(d.mu);
  /// A retired pool of sleep domain `domain` for (stream, key), or nullptr.
  stream_pool* adopt_locked(stream_handle stream, std::uint64_t key, std::uint32_t domain)
      REQUIRES(mu_);
  void requeue(std::deque<stream_pool*>& q, stream_pool* d) noexcept;

  device_backend& streams_;
  device_backend* events_ = nullptr;
  const std::uint64_t id_;  // unique per table, for the thread-local cache
  mutable shared_mutex mu_;
  std::vector<std::unique_ptr<stream_pool>> pools_ GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, stream_pool*> pool_by_stream_ GUARDED_BY(mu_);  // by key
  mutex quiet_mu_;                                                                  // a leaf
  // The candidates for retirement, oldest first -- quiet pools that hold cached memory (proof:
  // their quiet event), and pools that hold none (no proof needed).
  std::deque<stream_pool*> quiet_ GUARDED_BY(quiet_mu_);
  std::deque<stream_pool*> empty_ GUARDED_BY(quiet_mu_);
  std::atomic<std::uint64_t> adoptions_{0};
  // The ledger's queue of stale pools (stats_ledger.hpp; its steps in stats_ledger.cpp).
  mutable pool_ledger::stale_queue stale_;
};

}  // namespace cucache::detail
