// The thread's cached id of one created stream, for front ends that announce every stream
// destruction (docs/design.md, "Announced stream destructions").
//
// Why. Pools are keyed by the stream id, and an allocation on a created stream asks the driver
// for it (cuStreamGetId, ~16 ns on the H200) because the runtime hands a destroyed stream's
// handle value to the next stream it creates: a (handle -> id) cache could answer a new stream
// with a dead one's id. What would make the cache sound is knowing that no stream was destroyed
// since the entry was filled, and only code that sees every cuStreamDestroy knows that.
//
// Contract. While the mode is on (set_on(true)), the front end calls announce_destruction()
// before the driver destroys any stream that may be named to an allocator of the process -- the
// LD_PRELOAD shim does, from its cuStreamDestroy. An entry (owner, handle, id) filled under the
// process-wide count of announced destructions n answers for that handle while the count is
// still n: one destruction anywhere makes every thread's entry miss once, and the next
// allocation asks the driver again. Turning the mode on counts as a destruction, so nothing
// filled before (when destructions were not announced) is trusted.
//
// Ordering. announce_destruction is a sequentially consistent increment made before the driver
// destroys the stream; a thread that names the handle again got it from a stream creation that
// returned after that destruction, so its acquire load of the count sees the increment. The
// count is read before the driver is asked (fill's `count_before`): a destruction announced
// while the id query runs leaves the new entry stale at once.
//
// What the contract costs: the id query is also the captures-announced mode's failure rule (the
// driver refuses the id of a capturing stream, and the refusal invalidates the capture). A cache
// hit asks nothing, so a capture nobody announced on a stream whose id is cached is not found:
// the mode is only consulted while the captures-announced mode says nothing may be capturing,
// and is for front ends that see every capture as well as every destruction.
#pragma once

#include <atomic>
#include <cstdint>

#include "allocator/hot.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

/// The thread's one entry: which cache filled it, the stream handle, its id, and the count of
/// announced destructions it was filled under.
struct stream_id_entry {
  std::uint64_t owner = 0;  // 0: empty (owners start at 1)
  stream_handle stream = nullptr;
  std::uint64_t id = 0;
  std::uint64_t count = 0;
};
inline thread_local stream_id_entry t_stream_id_entry;

class stream_id_cache {
 public:
  stream_id_cache() noexcept : owner_(next_owner_.fetch_add(1, std::memory_order_relaxed)) {}
  stream_id_cache(const stream_id_cache&) = delete;
  stream_id_cache& operator=(const stream_id_cache&) = delete;

  /// The mode. On: a destruction is counted first, so that no entry filled before is trusted.
  void set_on(bool on) noexcept {
    if (on) announce_destruction();
    on_.store(on, std::memory_order_release);
  }
  [[nodiscard]] bool on() const noexcept { return on_.load(std::memory_order_acquire); }

  /// A stream of the process is about to be destroyed (every owner's entries miss once).
  static void announce_destruction() noexcept {
    destructions_.fetch_add(1, std::memory_order_seq_cst);
  }
  /// Destructions announced so far in the process (turning a mode on counts as one).
  [[nodiscard]] static std::uint64_t destructions() noexcept {
    return destructions_.load(std::memory_order_acquire);
  }

  /// The id this thread cached for `stream` under the current count, in `id`: true on a hit.
  /// False while the mode is off.
  CUCACHE_HOT bool find(stream_handle stream, std::uint64_t& id) const noexcept {
    if (!on_.load(std::memory_order_relaxed)) return false;
    const stream_id_entry& e = t_stream_id_entry;
    if (e.owner != owner_ || e.stream != stream) return false;
    if (e.count != destructions_.load(std::memory_order_acquire)) [[unlikely]]
      return false;
    id = e.id;
    return true;
  }
  /// Caches `id` for `stream` in this thread, valid while the count stays `count_before` (read
  /// with destructions() before the driver was asked). Call only while the mode is on.
  void fill(stream_handle stream, std::uint64_t id, std::uint64_t count_before) const noexcept {
    t_stream_id_entry = stream_id_entry{owner_, stream, id, count_before};
  }

 private:
  static inline std::atomic<std::uint64_t> destructions_{0};
  static inline std::atomic<std::uint64_t> next_owner_{1};

  const std::uint64_t owner_;  // unique per cache, for the thread-local entry
  std::atomic<bool> on_{false};
};

}  // namespace cucache::detail
