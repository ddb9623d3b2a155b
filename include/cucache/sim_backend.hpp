// A simulated device: a device_backend with a capacity, the driver's alignment and virtual-memory
// granularity, deterministic fake addresses, events that tests complete by hand, injected failures,
// a counter per call and, optionally, host memory behind every device byte. It is the device the
// algorithms are tested on without a GPU, and the device the replay tool uses on a CPU.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/sim_backend.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
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
  stream_synchronize,
  device_synchronize,
  mem_get_info,
  stream_id,
  capture_status,
  exchange_capture_mode,
  segment_export,
  segment_import,
  segment_close,
  phys_export_fd,
  phys_import_fd,
  host_alloc_pinned,
  host_free_pinned,
  copy_async,
  count_  // number of kinds; not a call
};
inline constexpr std::size_t k_sim_call_kinds = static_cast<std::size_t>(sim_call::count_);
[[nodiscard]] const char* to_string(sim_call call) noexcept;

/// cudaErrorInvalidResourceHandle's number: what the sim answers for a destroyed stream.
inline constexpr int k_sim_invalid_resource_handle = 400;
/// cudaErrorStreamCaptureUnsupported's number: what the sim answers for a call that is illegal
/// while a stream captures.
inline constexpr int k_sim_capture_unsupported = 900;
/// cudaErrorStreamCaptureInvalidated's number: end_capture of a capture an illegal call broke.
inline constexpr int k_sim_capture_invalidated = 901;
/// cudaErrorStreamCaptureWrongThread's number: a non-relaxed capture ended on another thread.
inline constexpr int k_sim_capture_wrong_thread = 908;
/// The id stream_id gives the legacy default stream (nullptr and cudaStreamLegacy, 0x1).
inline constexpr std::uint64_t k_sim_legacy_stream_id = std::uint64_t{1} << 61;

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
  /// create_stream hands out the handle value of the most recently destroyed stream again, as the
  /// CUDA runtime does (seen on the H200), with a new stream id.
  bool reuse_stream_handles = true;
  /// Number of simulated devices in the process (the registry's CUCACHE_SIM_DEVICES): the peers
  /// configure_peer_access chooses from.
  int device_count = 1;
  /// Page-locked host memory host_alloc_pinned may hold at once (the host's RAM and
  /// RLIMIT_MEMLOCK, as cudaHostAlloc meets them): beyond it host_alloc_pinned answers nullptr
  /// (cudaErrorMemoryAllocation), as the driver does. Unlimited by default.
  std::size_t pinned_capacity_bytes = ~std::size_t{0};
  /// Bit d set: device d can access this device's memory (cudaDeviceCanAccessPeer(d, device)).
  /// Every device can by default.
  std::uint64_t peer_mask = ~std::uint64_t{0};
};

/// The simulated device. Thread-safe: every call takes one internal mutex.
class sim_backend final : public device_backend {
 public:
  /// Device 0's first address; device d's window of 64 TiB starts d * 2^46 above it. It lies
  /// where Linux places nothing of the process (above the low binaries, below the PIE and mmap
  /// areas at 0x55... and 0x7f...) and clear of every ASan and TSan shadow layout: the real driver
  /// reserves its device ranges in the process's address space, so no host buffer shares an
  /// address with device memory, and the sim keeps that true without reserving anything.
  static constexpr std::uintptr_t k_first_address = 0x400000000000ULL;
  static constexpr std::size_t k_window_bytes = std::size_t{1} << 46;

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
  /// Grants access to every device of access_devices() (recorded per mapping: device_can_access).
  void set_access(void* va, std::size_t bytes) override;
  /// Peers among the device_count devices, by peer_mask: automatic takes those whose bit is set,
  /// all throws cuda_error 217 naming the first without it, none takes none.
  void configure_peer_access(peer_access_mode mode) override;
  [[nodiscard]] std::vector<int> access_devices() override;
  // Inter-process sharing. The sim has no second process: what a handle names is kept in a
  // process-wide table, so that any sim_backend of the process (another one standing for the
  // other process, or this one, which then acts as another process would) opens it at an address
  // of its own window, with the same host memory behind it. A segment's handle is valid until
  // the segment is freed; a descriptor of phys_export_fd is a real file descriptor (a memfd
  // naming the table entry, valid until the exporter releases the handle), so it can travel over
  // a unix socket (SCM_RIGHTS) like the driver's.
  void enable_phys_export() override;
  [[nodiscard]] segment_ipc_handle segment_export(void* base) override;
  [[nodiscard]] void* segment_import(const segment_ipc_handle& handle) override;
  void segment_close(void* base) override;
  [[nodiscard]] int phys_export_fd(phys_handle handle) override;
  [[nodiscard]] phys_handle phys_import_fd(int fd) override;
  [[nodiscard]] event_handle event_create() override;
  void event_destroy(event_handle event) override;
  void event_record(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool event_query(event_handle event) override;
  void event_synchronize(event_handle event) override;
  void stream_synchronize(stream_handle stream) override;
  void device_synchronize() override;
  [[nodiscard]] memory_info mem_get_info() override;
  [[nodiscard]] void* host_alloc_pinned(std::size_t bytes) override;
  void host_free_pinned(void* ptr) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override;
  [[nodiscard]] std::uint64_t stream_id(stream_handle stream) override;
  [[nodiscard]] capture_info capture_status(stream_handle stream) override;
  /// cuda_backend's rule, counted as the calls it makes: the legacy stream (nullptr,
  /// cudaStreamLegacy) none; cudaStreamPerThread capture_status, and stream_id once per thread;
  /// any other stream capture_status then stream_id, with one test of the lock-free case (a
  /// handle the sim did not create, no capture anywhere) for both.
  [[nodiscard]] stream_identity identify(stream_handle stream) override;
  capture_mode exchange_capture_mode(capture_mode mode) override;

  // --- Streams ----------------------------------------------------------------------------------
  // The driver rejects a destroyed stream (cudaErrorInvalidResourceHandle) -- or, on a real
  // device, may crash on the dangling handle -- so the sim keeps a registry: streams it created
  // (create_stream) are alive until destroy_stream; every handle it never created (the legacy
  // default stream and the fake values tests pass, e.g. reinterpret_cast<stream_handle>(0x100))
  // counts as alive. The legacy stream has two handles, nullptr and cudaStreamLegacy (0x1, so no
  // fake stream of its own): one id, k_sim_legacy_stream_id, and never a capture.
  // event_record and stream_synchronize on a destroyed stream throw cuda_error with code 400
  // (k_sim_invalid_resource_handle). Work recorded on a stream before it was destroyed still
  // completes (complete_stream, complete_all, device_synchronize), as on the driver. Like the
  // runtime, create_stream hands a destroyed stream's handle value to the next stream it creates
  // (sim_options::reuse_stream_handles), which is then alive again; the stream id (stream_id) is
  // never reused: every created stream has its own, counted from 1. Other handles the sim did not
  // create have the id (1 << 62) | value; cudaStreamPerThread (0x2) is one such handle, the same
  // stream in every thread (the sim does not model a stream per thread).
  /// A new stream (cudaStreamCreate): a non-null handle no test's fake stream collides with.
  [[nodiscard]] stream_handle create_stream();
  /// Destroys a stream from create_stream (cudaStreamDestroy). Throws cuda_error (400) for a
  /// handle the sim did not create or has destroyed already.
  void destroy_stream(stream_handle stream);
  /// True when `stream` came from create_stream and has been destroyed since.
  [[nodiscard]] bool stream_destroyed(stream_handle stream) const;
  /// Calls rejected so far because they named a destroyed stream.
  [[nodiscard]] std::uint64_t destroyed_stream_calls() const;

  // --- Graph capture -------------------------------------------------------------------------
  // The driver's rules, enforced: while a stream captures, a "potentially unsafe" call
  // (segment_malloc, segment_free, va_reserve, va_free, phys_create, phys_release, map, unmap,
  // set_access, event_query, event_synchronize, stream_synchronize, mem_get_info) from a thread
  // whose capture mode (exchange_capture_mode, per thread as in CUDA) is not relaxed is refused
  // when any capture began in global mode or the thread itself captures (not relaxed); calls that
  // conflict with a capture by nature are refused in every mode: device_synchronize and
  // segment_free (cudaFree synchronizes the device) while any stream captures,
  // stream_synchronize of a capturing stream, event_query / event_synchronize of an event last
  // recorded on a capturing stream (recording one there is legal: the capture records it). A
  // refused call throws cuda_error 900 (k_sim_capture_unsupported), is counted
  // (capture_violations) and invalidates the captures that made it illegal: their end_capture
  // throws 901. event_record, event_create and event_destroy are always legal.
  /// Begins capturing `stream` (cudaStreamBeginCapture) in `mode` on the calling thread; returns
  /// the capture id (1, 2, ...). Throws cuda_error for the legacy stream (nullptr or
  /// cudaStreamLegacy: code 1, cudaErrorInvalidValue), a destroyed stream or one already
  /// capturing.
  std::uint64_t begin_capture(stream_handle stream, capture_mode mode = capture_mode::global);
  /// Ends the capture of `stream` (cudaStreamEndCapture); returns its id. Throws cuda_error 901
  /// (ending it) when an illegal call invalidated it, 908 (not ending it) when a capture that was
  /// not begun in relaxed mode is ended on another thread, 1 when the stream does not capture.
  std::uint64_t end_capture(stream_handle stream);
  /// Calls refused so far because a stream captured.
  [[nodiscard]] std::uint64_t capture_violations() const;
  /// Number of streams capturing now.
  [[nodiscard]] std::size_t active_captures() const;

  // --- Test controls ----------------------------------------------------------------------------
  /// Completes every event recorded so far on `stream` (the stream "catches up"). After a handle
  /// was reused, that is the stream it names now; a destroyed stream's handle names it still.
  void complete_stream(stream_handle stream);
  /// Completes every event recorded so far on the stream with id `id` (a destroyed one too).
  void complete_stream_id(std::uint64_t id);
  /// Completes every event recorded so far.
  void complete_all();
  /// Number of recorded events that have not completed.
  [[nodiscard]] std::size_t pending_events() const;
  /// Event records that completing events (segment_free and device_synchronize, which synchronize
  /// the device; stream_synchronize; complete_stream, complete_all) visited so far: the sim's own
  /// work, proportional to the events those calls completed, not to every event that exists.
  [[nodiscard]] std::uint64_t event_visits() const;
  /// Makes the n-th future call of `kind` fail (n = 1: the next one). For segment_malloc,
  /// phys_create and va_reserve the failure is out-of-memory (of the device, or of address
  /// space); for every other call a thrown cuda_error.
  void fail_nth(sim_call kind, std::uint64_t n);
  /// Makes every call of `kind` fail (or stop failing) until changed.
  void fail_always(sim_call kind, bool enabled = true);
  /// Changes the capacity (e.g. to simulate another process taking memory).
  void set_capacity(std::size_t bytes);
  /// Number of calls of `kind` made so far (failed ones included). stream_id, capture_status and
  /// exchange_capture_mode are counted without a lock: exact unless they race on several threads.
  [[nodiscard]] std::uint64_t calls(sim_call kind) const;
  /// Physical bytes in use (segments plus physical handles).
  [[nodiscard]] std::size_t used_bytes() const;
  /// Number of live segments, physical handles, reservations and mappings.
  [[nodiscard]] std::size_t live_segments() const;
  [[nodiscard]] std::size_t live_handles() const;
  [[nodiscard]] std::size_t live_reservations() const;
  [[nodiscard]] std::size_t live_mappings() const;
  /// Mappings no set_access has covered yet (the driver maps without access: a kernel touching
  /// one faults).
  [[nodiscard]] std::size_t inaccessible_mappings() const;
  /// Whether every byte of [va, va + bytes) is mapped and covered by a set_access.
  [[nodiscard]] bool accessible(const void* va, std::size_t bytes) const;
  /// Pinned host memory held (host_alloc_pinned, not yet freed): its bytes and its blocks.
  [[nodiscard]] std::size_t pinned_bytes() const;
  [[nodiscard]] std::size_t live_pinned() const;
  /// Segments opened with segment_import and not closed.
  [[nodiscard]] std::size_t live_imports() const;
  /// Whether kernels on `device` may read and write every byte of [ptr, ptr + bytes): within
  /// mappings, the devices set_access granted; within segments and imports, this device only
  /// (the sim does not model cudaDeviceEnablePeerAccess). False for memory the sim does not hold.
  [[nodiscard]] bool device_can_access(int device, const void* ptr, std::size_t bytes) const;
  /// Host memory behind [dev_ptr, dev_ptr + bytes); nullptr unless host_memory is on and the range
  /// lies in one segment or one mapping.
  [[nodiscard]] std::byte* host_view(const void* dev_ptr, std::size_t bytes);
  [[nodiscard]] const sim_options& options() const noexcept { return options_; }

 private:
  struct segment_rec {
    std::size_t bytes;
    std::shared_ptr<std::byte[]> host;
    std::uint64_t export_id = 0;  // the process-wide export table's entry; 0 = not exported
  };
  struct handle_rec {
    std::size_t bytes;
    std::size_t map_count = 0;
    std::shared_ptr<std::byte[]> host;
    std::uint64_t export_id = 0;
    bool imported = false;  // from phys_import_fd: not charged to this device
  };
  struct mapping_rec {
    std::size_t bytes;
    phys_handle handle;
    std::uint64_t access = 0;  // bit d: device d may access it (set_access)
  };
  struct import_rec {
    std::size_t bytes;
    std::shared_ptr<std::byte[]> host;
  };
  struct event_rec {
    bool recorded = false;
    bool complete = true;
    bool captured = false;     // last recorded on a capturing stream
    std::uint64_t stream = 0;  // id of the stream it was recorded on
  };
  struct capture_rec {
    std::uint64_t id;
    capture_mode mode;
    std::thread::id thread;
    bool invalidated = false;
  };

  bool should_fail(sim_call kind);  // REQUIRES: mu_ held; counts the call
  /// identify of the legacy stream's handles and cudaStreamPerThread (out of line: rare here).
  [[gnu::noinline]] stream_identity identify_special(stream_handle stream);
  /// The id of `stream`; for a destroyed one, the id it had. REQUIRES: mu_ held.
  std::uint64_t id_of_locked(stream_handle stream) const;
  /// Throws cuda_error (900) when a potentially unsafe call is illegal now. REQUIRES: mu_ held.
  void require_capture_safe(sim_call kind);
  /// Throws cuda_error (900) when any stream captures (a device-wide synchronization).
  /// REQUIRES: mu_ held.
  void require_no_capture(sim_call kind);
  [[noreturn]] void capture_violation(sim_call kind, const std::string& why);
  /// True when the stream-query call `kind` may skip the mutex (nothing injected for it).
  [[nodiscard]] bool query_fast(sim_call kind) noexcept;
  /// Throws cuda_error (400) naming `kind` when `stream` was destroyed. REQUIRES: mu_ held.
  void require_live_stream(sim_call kind, stream_handle stream);
  [[noreturn]] void fail(sim_call kind, const std::string& why, int code = 999) const;
  /// Whether `ev` is in pending_by_stream_ (recorded, not captured, not complete).
  [[nodiscard]] static bool is_pending(const event_rec& ev) noexcept {
    return ev.recorded && !ev.captured && !ev.complete;
  }
  /// Removes event `id`, whose record is `ev`, from pending_by_stream_ if there. REQUIRES: mu_
  /// held.
  void forget_pending(std::uintptr_t id, const event_rec& ev) noexcept;
  /// Completes the pending events of `ids` and forgets them. REQUIRES: mu_ held.
  void complete_pending(std::unordered_set<std::uintptr_t>& ids) noexcept;
  /// Completes every pending event (a device-wide synchronization). REQUIRES: mu_ held.
  void complete_all_locked() noexcept;
  std::uintptr_t take_address(std::size_t bytes, std::size_t align);  // REQUIRES: mu_ held
  void give_address(std::uintptr_t addr, std::size_t bytes);          // REQUIRES: mu_ held
  std::size_t page_round(std::size_t bytes) const;

  sim_options options_;
  const std::uint64_t serial_;  // unique per sim in the process (identify's per-thread keeping)
  mutable std::mutex mu_;
  std::array<std::atomic<std::uint64_t>, k_sim_call_kinds> calls_{};
  std::array<std::uint64_t, k_sim_call_kinds> fail_at_{};  // absolute call number to fail; 0 = none
  std::array<bool, k_sim_call_kinds> fail_always_{};
  std::size_t used_ = 0;
  std::map<std::uintptr_t, std::size_t>
      free_ranges_;  // address space not handed out: addr -> bytes
  std::map<std::uintptr_t, segment_rec> segments_;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, mapping_rec> mappings_;
  std::unordered_map<phys_handle, handle_rec> handles_;
  std::map<std::uintptr_t, import_rec> imports_;
  std::map<std::uintptr_t, std::size_t> pinned_;  // host_alloc_pinned's blocks: addr -> bytes
  std::size_t pinned_bytes_ = 0;                  // their sum
  std::vector<int> access_devices_;               // set_access's devices; empty = this device alone
  bool phys_export_ = false;
  phys_handle next_handle_ = 1;
  std::unordered_map<std::uintptr_t, event_rec> events_;
  std::uintptr_t next_event_ = 0x1000;
  // The events that are recorded, not captured and not complete, by the id of the stream they
  // were recorded on: what a synchronization completes, so that its cost is what it completes
  // (a segment_free visited every event that exists: issue 30 item 9).
  std::unordered_map<std::uint64_t, std::unordered_set<std::uintptr_t>> pending_by_stream_;
  std::uint64_t event_visits_ = 0;                                      // event_visits()
  std::unordered_map<stream_handle, std::uint64_t> live_streams_;       // created, alive: id
  std::unordered_map<stream_handle, std::uint64_t> destroyed_streams_;  // destroyed, not reused
  std::vector<stream_handle> reusable_handles_;  // destroyed handles, most recent last
  std::atomic<std::uintptr_t> next_stream_;      // handles below it (from the base) are created
  std::uint64_t next_stream_id_ = 1;
  std::uint64_t destroyed_stream_calls_ = 0;
  std::unordered_map<stream_handle, capture_rec> captures_;
  std::atomic<std::size_t> capturing_{0};  // captures_.size(), read without the mutex
  std::uint64_t next_capture_id_ = 1;
  std::uint64_t capture_violations_ = 0;
  std::atomic<bool> query_faults_{false};  // a failure was injected into a stream query
};

}  // namespace cucache
