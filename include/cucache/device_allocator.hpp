// The caching allocator of one device: the public face of the core. Thread-safe. Each stream has
// its own pool and lock, so threads on different streams do not serialize; device calls and the
// out-of-memory ladder take a device-wide path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cucache/backend.hpp"
#include "cucache/config.hpp"
#include "cucache/stats.hpp"

namespace cucache {

/// Told of every allocation and free of a device_allocator (tracing, and later leak detection
/// and tags, are observers). Calls are made on the allocating or freeing thread, without any
/// allocator-wide lock, in an order consistent with address reuse: on_free for a block is called
/// before its memory can be handed out again, on_allocate before allocate returns. Observers
/// must be thread-safe and must not call back into the allocator.
class allocation_observer {
 public:
  virtual ~allocation_observer() = default;
  /// `ptr` was handed out for `requested` bytes (the caller's size, not the rounded one).
  virtual void on_allocate(const void* ptr, std::size_t requested,
                           stream_handle stream) noexcept = 0;
  /// `ptr`, an allocation of `requested` bytes, is being freed in the order of `stream` (the
  /// allocation's own stream for a plain free).
  virtual void on_free(const void* ptr, std::size_t requested, stream_handle stream) noexcept = 0;
  /// An allocation of `requested` bytes on `stream` failed (it threw).
  virtual void on_failure(std::size_t requested, stream_handle stream) noexcept = 0;
};

class device_allocator {
 public:
  /// An allocator over `backend` (one device). Throws invalid_argument on an inconsistent config.
  /// `observer`, when given, is told of every allocation and free for the allocator's life.
  explicit device_allocator(std::shared_ptr<device_backend> backend, config cfg = {},
                            std::shared_ptr<allocation_observer> observer = nullptr);
  /// Returns every segment to the device, live blocks included: destroy only when done with all.
  ~device_allocator();
  device_allocator(const device_allocator&) = delete;
  device_allocator& operator=(const device_allocator&) = delete;

  /// Allocates `bytes` for use on `stream`. bytes == 0 returns nullptr (as cudaMalloc does).
  /// Throws out_of_memory when the device refuses after the whole out-of-memory ladder, and
  /// cuda_error when the device fails otherwise; the allocator is unchanged by a failed call.
  [[nodiscard]] void* allocate(std::size_t bytes, stream_handle stream = nullptr);
  /// Frees a block: at once reusable on its own stream, or, when it was used on other streams
  /// (record_stream), once events recorded on those streams now have completed.
  /// nullptr is a no-op. Throws invalid_argument for an unknown, interior or already-freed
  /// pointer, leaving the allocator untouched.
  void deallocate(void* ptr);
  /// Frees a block in the order of `stream` (cudaFreeAsync): if `stream` is not the block's own
  /// stream, its reuse waits for the work queued on `stream` now.
  void deallocate(void* ptr, stream_handle stream);
  /// Marks a live block as used on `stream` too, deferring its reuse after free until the work
  /// queued on `stream` at free time has completed. Throws invalid_argument on a pointer that is
  /// not the start of a live block.
  void record_stream(void* ptr, stream_handle stream);
  /// As deallocate(ptr, stream) -- or deallocate(ptr) when `ordered` is false -- but answers false,
  /// changing nothing, when ptr is not the start of a live allocation of this allocator. The
  /// owner search of a multi-device front end: no exception, no diagnosis, no device-wide lock.
  [[nodiscard]] bool try_deallocate(void* ptr, stream_handle stream, bool ordered);
  /// As record_stream, but answers false, changing nothing, for a pointer that is not the start of
  /// a live allocation of this allocator.
  [[nodiscard]] bool try_record_stream(void* ptr, stream_handle stream);
  /// Why `ptr` is not the start of a live allocation here (unknown, interior, already freed), as
  /// the invalid_argument that deallocate would throw says it: "cucache: <what>(<ptr>) on device
  /// N: <why>". Takes every pool lock: for error paths.
  [[nodiscard]] std::string explain_bad_pointer(const void* ptr, const char* what) const;
  /// Where an address falls in this allocator's memory: `in_segment` when inside a segment it
  /// reserved; then `block`/`block_size` are the block holding it and `live` whether that block
  /// is allocated. What a front end that forwards foreign pointers (the LD_PRELOAD shim) needs to
  /// tell "not ours" from "ours, but not a live allocation's start". Takes every pool lock: for
  /// error paths.
  struct address_info {
    bool in_segment = false;
    bool live = false;
    std::uintptr_t block = 0;
    std::size_t block_size = 0;
  };
  [[nodiscard]] address_info locate(const void* ptr) const;
  /// Waits for pending frees, then returns every whole free segment to the device.
  void empty_cache();

  /// Statistics, taken consistently under all locks.
  [[nodiscard]] device_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  /// PyTorch-style text table of the statistics (see docs/api.md).
  [[nodiscard]] std::string memory_summary() const;
  /// JSON description of every segment and block (see docs/api.md).
  [[nodiscard]] std::string snapshot_json() const;
  /// Size of the block holding ptr (its rounded size) or 0 when ptr is not a live allocation.
  [[nodiscard]] std::size_t allocation_size(const void* ptr) const;

  /// Checks every structural invariant (blocks tile segments, no adjacent free blocks, the free
  /// index holds exactly the free blocks, stats equal a recount). Throws std::logic_error naming
  /// the first violation. For tests; takes all locks and walks everything. REQUIRES: no other
  /// thread is freeing meanwhile (a free leaves the pointer map before it takes its pool's lock,
  /// so a concurrent check could see a block in between and report a false violation).
  void check_invariants() const;

  [[nodiscard]] const config& get_config() const noexcept;
  [[nodiscard]] int device() const noexcept;
  [[nodiscard]] device_backend& backend() const noexcept;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace cucache
