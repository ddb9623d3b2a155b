// The replay loop shared by cucache and every peer: one pass over the prepared operations, timed
// with steady_clock around the whole loop. A template over the allocator so that each loop body
// is a direct call, not a virtual one, and the sampling hook vanishes from timed runs.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <span>

#include "replay_engine.hpp"

namespace cucache::replay {

/// What one pass measured.
struct pass_result {
  std::chrono::nanoseconds elapsed{0};
  /// Allocations refused (out of memory); their frees were skipped.
  std::uint64_t failed_allocations = 0;
  /// Wakes refused (no room for the tag's pages), counted in failed_allocations too (a pass that
  /// stops, stops there). A pass that goes on leaves the tag asleep: its next sleep, the frees of
  /// its blocks and allocations under it (skipped_asleep) make no call.
  std::uint64_t failed_wakes = 0;
  std::uint64_t skipped_asleep = 0;
};

/// An allocator that replays sleep and wake rows (cucache's, replay_engine.cpp) provides
///   void set_domain(std::uint16_t domain)       -- the sleep domain of the next allocations
///   void sleep(std::uint16_t domain, bool keep_contents)
///   bool wake(std::uint16_t domain)             -- false when out of memory (it stays asleep)
///   bool asleep(std::uint16_t domain)
/// Peers have none of them: check_sleep_replayable keeps traces that sleep away from them.
template <class Allocator>
concept sleeping_allocator = requires(Allocator& a, std::uint16_t d) {
  a.set_domain(d);
  a.sleep(d, true);
  { a.wake(d) } -> std::same_as<bool>;
  { a.asleep(d) } -> std::same_as<bool>;
};

/// What a pass does after an allocation fails: go on without the block (the figures of a replay
/// under a limit), or stop there (--fit needs to know only whether any allocation fails).
enum class on_failure : std::uint8_t { go_on, stop };

/// Never called in timed runs; exists so they pass a hook that compiles to nothing.
struct no_hook {
  void operator()(std::size_t /*op_index*/) const noexcept {}
};

/// Replays every operation through `a`, which provides
///   void* allocate(std::size_t bytes, stream_handle stream)   -- nullptr when out of memory
///   void deallocate(void* ptr, stream_handle stream, bool other_stream)
/// `slots` (one per operation) receives the replay pointers; `after_allocate(i)` runs after each
/// successful allocation (and wake). Pointers still live at the end (or at the failure that
/// stopped the pass) stay in `slots` for the caller to free.
template <on_failure failure = on_failure::go_on, class Allocator, class Hook = no_hook>
pass_result run_pass(const prepared_trace& trace, std::span<const stream_handle> streams,
                     std::span<void*> slots, Allocator& a, Hook&& after_allocate = {}) {
  pass_result r;
  const replay_op* const ops = trace.ops.data();
  const std::size_t n = trace.ops.size();
  void** const slot = slots.data();
  const stream_handle* const stream = streams.data();
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    const replay_op& op = ops[i];
    switch (op.kind) {
      case op_kind::allocate: {
        if constexpr (sleeping_allocator<Allocator>) {
          if (op.domain != 0 && a.asleep(op.domain)) {  // after a refused wake
            ++r.skipped_asleep;
            break;
          }
          a.set_domain(op.domain);
        }
        void* p = a.allocate(op.size, stream[op.stream]);
        slot[op.slot] = p;
        if (p == nullptr) {
          ++r.failed_allocations;
          if constexpr (failure == on_failure::stop) {
            r.elapsed = std::chrono::steady_clock::now() - start;
            return r;
          }
        } else {
          after_allocate(i);
        }
        break;
      }
      case op_kind::free:
      case op_kind::free_on_other_stream:
        if (void* p = slot[op.slot]; p != nullptr) {
          if constexpr (sleeping_allocator<Allocator>) {
            if (op.domain != 0 && a.asleep(op.domain)) break;  // after a refused wake
          }
          a.deallocate(p, stream[op.stream], op.kind == op_kind::free_on_other_stream);
          slot[op.slot] = nullptr;
        }
        break;
      case op_kind::sleep:
      case op_kind::sleep_keep:
      case op_kind::wake:
        if constexpr (sleeping_allocator<Allocator>) {
          if (op.kind != op_kind::wake) {
            if (!a.asleep(op.domain)) a.sleep(op.domain, op.kind == op_kind::sleep_keep);
          } else if (!a.wake(op.domain)) {
            ++r.failed_allocations;
            ++r.failed_wakes;
            if constexpr (failure == on_failure::stop) {
              r.elapsed = std::chrono::steady_clock::now() - start;
              return r;
            }
          } else {
            after_allocate(i);  // a wake maps memory again: reserved may peak here
          }
        }
        break;
      case op_kind::none:
        break;
    }
  }
  r.elapsed = std::chrono::steady_clock::now() - start;
  return r;
}

}  // namespace cucache::replay
