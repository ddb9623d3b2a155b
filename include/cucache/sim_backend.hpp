// A simulated device: a device_backend with a capacity, the driver's alignment and virtual-memory
// granularity, deterministic fake addresses, events that tests complete by hand, injected failures,
// a counter per call and, optionally, host memory behind every device byte. It is the device the
// algorithms are tested on without a GPU, and the device the replay tool uses on a CPU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cucache/backend.hpp"

namespace cucache {

/// Every kind of call a device_backend serves, for counters and failure injection.
enum class sim_call : std::uint8_t {
  segment_malloc,
  segment_free,
  vm_granularity,
  va_reserve,
  va_free,
  phys_create,
  phys_release,
  map,
  unmap,
  set_access,
  event_create,
  event_destroy,
  event_record,
  event_query,
  event_synchronize,
  stream_wait_event,
  stream_synchronize,
  device_synchronize,
  mem_get_info,
  count_  // number of kinds; not a call
};
inline constexpr std::size_t k_sim_call_kinds = static_cast<std::size_t>(sim_call::count_);
[[nodiscard]] const char* to_string(sim_call call) noexcept;

/// cudaErrorInvalidResourceHandle's number: what the sim answers for a destroyed stream.
inline constexpr int k_sim_invalid_resource_handle = 400;

/// Options of a simulated device.
struct sim_options {
  /// Device ordinal in [0, 64). Each has an address window of its own (no two devices ever hand
  /// out the same address, as with the one virtual address space of real GPUs).
  int device = 0;
  /// Physical memory of the device in bytes (80 GiB: an A100/H100-class card).
  std::size_t capacity_bytes = std::size_t{80} << 30;
  /// VM allocation granularity; 0 simulates a device without virtual-memory support.
  std::size_t granularity_bytes = std::size_t{2} << 20;
  /// cudaMalloc hands out whole pages of this size: addresses are aligned to it and a segment
  /// consumes capacity rounded up to it (the real driver's behaviour for large allocations).
  std::size_t malloc_page_bytes = std::size_t{2} << 20;
  /// Back every device byte by host memory so tests can write and check contents.
  bool host_memory = false;
  /// Events complete as soon as they are recorded (a device that is never busy).
  bool events_complete_immediately = false;
};

/// The simulated device. Thread-safe: every call takes one internal mutex.
class sim_backend final : public device_backend {
 public:
  explicit sim_backend(sim_options options = {});
  ~sim_backend() override;
  sim_backend(const sim_backend&) = delete;
  sim_backend& operator=(const sim_backend&) = delete;

  // device_backend
  [[nodiscard]] int device() const noexcept override { return options_.device; }
  [[nodiscard]] const char* name() const noexcept override { return "sim"; }
  [[nodiscard]] void* segment_malloc(std::size_t bytes) override;
  void segment_free(void* ptr) override;
  [[nodiscard]] std::size_t vm_granularity() override;
  [[nodiscard]] void* va_reserve(std::size_t bytes) override;
  void va_free(void* base, std::size_t bytes) override;
  [[nodiscard]] std::optional<phys_handle> phys_create(std::size_t bytes) override;
  void phys_release(phys_handle handle) override;
  void map(void* va, std::size_t bytes, phys_handle handle) override;
  void unmap(void* va, std::size_t bytes) override;
  void set_access(void* va, std::size_t bytes) override;
  [[nodiscard]] event_handle event_create() override;
  void event_destroy(event_handle event) override;
  void event_record(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool event_query(event_handle event) override;
  void event_synchronize(event_handle event) override;
  void stream_wait_event(stream_handle stream, event_handle event) override;
  void stream_synchronize(stream_handle stream) override;
  void device_synchronize() override;
  [[nodiscard]] memory_info mem_get_info() override;

  // --- Streams ----------------------------------------------------------------------------------
  // The driver rejects a destroyed stream (cudaErrorInvalidResourceHandle) -- or, on a real
  // device, may crash on the dangling handle -- so the sim keeps a registry: streams it created
  // (create_stream) are alive until destroy_stream; every handle it never created (nullptr, the
  // legacy default stream, and the fake values tests pass, e.g. reinterpret_cast<stream_handle>(1))
  // counts as alive. event_record, stream_wait_event and stream_synchronize on a destroyed stream
  // throw cuda_error with code 400 (k_sim_invalid_resource_handle). Work recorded on a stream
  // before it was destroyed still completes (complete_stream, complete_all, device_synchronize),
  // as on the driver. Created handles are never handed out twice.
  /// A new stream (cudaStreamCreate): a non-null handle no test's fake stream collides with.
  [[nodiscard]] stream_handle create_stream();
  /// Destroys a stream from create_stream (cudaStreamDestroy). Throws cuda_error (400) for a
  /// handle the sim did not create or has destroyed already.
  void destroy_stream(stream_handle stream);
  /// True when `stream` came from create_stream and has been destroyed since.
  [[nodiscard]] bool stream_destroyed(stream_handle stream) const;
  /// Calls rejected so far because they named a destroyed stream.
  [[nodiscard]] std::uint64_t destroyed_stream_calls() const;

  // --- Test controls ----------------------------------------------------------------------------
  /// Completes every event recorded so far on `stream` (the stream "catches up").
  void complete_stream(stream_handle stream);
  /// Completes every event recorded so far.
  void complete_all();
  /// Number of recorded events that have not completed.
  [[nodiscard]] std::size_t pending_events() const;
  /// Makes the n-th future call of `kind` fail (n = 1: the next one). For segment_malloc and
  /// phys_create the failure is out-of-memory; for every other call a thrown cuda_error.
  void fail_nth(sim_call kind, std::uint64_t n);
  /// Makes every call of `kind` fail (or stop failing) until changed.
  void fail_always(sim_call kind, bool enabled = true);
  /// Changes the capacity (e.g. to simulate another process taking memory).
  void set_capacity(std::size_t bytes);
  /// Number of calls of `kind` made so far (failed ones included).
  [[nodiscard]] std::uint64_t calls(sim_call kind) const;
  /// Physical bytes in use (segments plus physical handles).
  [[nodiscard]] std::size_t used_bytes() const;
  /// Number of live segments, physical handles, reservations and mappings.
  [[nodiscard]] std::size_t live_segments() const;
  [[nodiscard]] std::size_t live_handles() const;
  [[nodiscard]] std::size_t live_reservations() const;
  [[nodiscard]] std::size_t live_mappings() const;
  /// Host memory behind [dev_ptr, dev_ptr + bytes); nullptr unless host_memory is on and the range
  /// lies in one segment or one mapping.
  [[nodiscard]] std::byte* host_view(const void* dev_ptr, std::size_t bytes);
  [[nodiscard]] const sim_options& options() const noexcept { return options_; }

 private:
  struct segment_rec {
    std::size_t bytes;
    std::unique_ptr<std::byte[]> host;
  };
  struct handle_rec {
    std::size_t bytes;
    std::size_t map_count = 0;
    std::unique_ptr<std::byte[]> host;
  };
  struct mapping_rec {
    std::size_t bytes;
    phys_handle handle;
    bool accessible = false;
  };
  struct event_rec {
    bool recorded = false;
    bool complete = true;
    stream_handle stream = nullptr;
  };

  bool should_fail(sim_call kind);  // REQUIRES: mu_ held; counts the call
  /// Throws cuda_error (400) naming `kind` when `stream` was destroyed. REQUIRES: mu_ held.
  void require_live_stream(sim_call kind, stream_handle stream);
  [[noreturn]] void fail(sim_call kind, const std::string& why, int code = 999) const;
  std::uintptr_t take_address(std::size_t bytes, std::size_t align);  // REQUIRES: mu_ held
  void give_address(std::uintptr_t addr, std::size_t bytes);          // REQUIRES: mu_ held
  std::size_t page_round(std::size_t bytes) const;

  sim_options options_;
  mutable std::mutex mu_;
  std::array<std::uint64_t, k_sim_call_kinds> calls_{};
  std::array<std::uint64_t, k_sim_call_kinds> fail_at_{};  // absolute call number to fail; 0 = none
  std::array<bool, k_sim_call_kinds> fail_always_{};
  std::size_t used_ = 0;
  std::map<std::uintptr_t, std::size_t>
      free_ranges_;  // address space not handed out: addr -> bytes
  std::map<std::uintptr_t, segment_rec> segments_;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, mapping_rec> mappings_;
  std::unordered_map<phys_handle, handle_rec> handles_;
  phys_handle next_handle_ = 1;
  std::unordered_map<std::uintptr_t, event_rec> events_;
  std::uintptr_t next_event_ = 0x1000;
  std::unordered_set<stream_handle> live_streams_;       // created and not destroyed
  std::unordered_set<stream_handle> destroyed_streams_;  // created, then destroyed
  std::uintptr_t next_stream_;
  std::uint64_t destroyed_stream_calls_ = 0;
};

}  // namespace cucache
