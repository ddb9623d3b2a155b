// The caching allocator of one device: the public face of the core. Thread-safe. Each stream has
// its own pool and lock, so threads on different streams do not serialize; device calls and the
// out-of-memory ladder take a device-wide path.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/device_allocator.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <atomic>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
  /// Called, while admits() is true, before the allocator acts on a request of `requested` (> 0)
  /// bytes on `stream`: what it throws refuses the allocation with nothing changed (no
  /// on_failure follows; tag limits throw tag_limit_error here). When it returns, exactly one of
  /// on_allocate and on_failure follows on the same thread. Default: admits everything.
  virtual void admit(std::size_t requested, stream_handle stream) {
    static_cast<void>(requested), static_cast<void>(stream);
  }
  /// Whether the allocator calls admit: false until the observer says so (set_admits), so that an
  /// observer that never refuses costs no call.
  [[nodiscard]] bool admits() const noexcept { return admits_.load(std::memory_order_acquire); }

 protected:
  void set_admits(bool on) noexcept { admits_.store(on, std::memory_order_release); }

 private:
  std::atomic<bool> admits_{false};

 public:
  /// A cudaMalloc'd segment of `bytes` at `base` was created for the pool of `stream` (called
  /// under that pool's lock, before any block of it is handed out). Default: ignored.
  virtual void on_segment_alloc(std::uintptr_t base, std::size_t bytes,
                                stream_handle stream) noexcept {
    static_cast<void>(base), static_cast<void>(bytes), static_cast<void>(stream);
  }
  /// The cudaMalloc'd segment at `base` was returned to the device (under its pool's lock, after
  /// the device call). Default: ignored.
  virtual void on_segment_free(std::uintptr_t base, std::size_t bytes,
                               stream_handle stream) noexcept {
    static_cast<void>(base), static_cast<void>(bytes), static_cast<void>(stream);
  }
  /// Expandable segments: `bytes` at `base` in the pool of `stream`'s address range were mapped
  /// and made accessible (one call per run of pages given access at once), under that pool's
  /// lock, before any block there is handed out. PyTorch's SEGMENT_MAP. Default: ignored.
  virtual void on_segment_map(std::uintptr_t base, std::size_t bytes,
                              stream_handle stream) noexcept {
    static_cast<void>(base), static_cast<void>(bytes), static_cast<void>(stream);
  }
  /// Expandable segments: the accessible mapping of `bytes` at `base` is about to be unmapped
  /// (one call per mapping: a page, or a chunk of pages), under its pool's lock. PyTorch's
  /// SEGMENT_UNMAP. Default: ignored.
  virtual void on_segment_unmap(std::uintptr_t base, std::size_t bytes,
                                stream_handle stream) noexcept {
    static_cast<void>(base), static_cast<void>(bytes), static_cast<void>(stream);
  }
};

/// Names a private pool of CUDA graph memory (PyTorch's MempoolId_t). A program (or PyTorch,
/// through the plug-in) chooses any pair other than {0, 0} for begin_allocate_to_pool; a capture
/// that nothing routes gets the pool of_capture(its capture id), created by its first allocation.
struct graph_pool_id {
  std::uint64_t first = 0;
  std::uint64_t second = 0;
  /// first of the pools captures get automatically; PyTorch's ids never use it.
  static constexpr std::uint64_t k_capture = ~std::uint64_t{0};
  /// The pool of capture `capture_id` (cudaStreamGetCaptureInfo's id).
  [[nodiscard]] static constexpr graph_pool_id of_capture(std::uint64_t capture_id) noexcept {
    return {k_capture, capture_id};
  }
  friend constexpr auto operator<=>(const graph_pool_id&, const graph_pool_id&) = default;
};

/// One block of a segment, as segments() lists it.
struct block_view {
  enum class state : std::uint8_t { allocated, pending, free };
  std::uintptr_t address = 0;
  std::size_t size = 0;       ///< bytes the block spans (the rounded size)
  std::size_t requested = 0;  ///< the caller's size for an allocated block, else 0
  state st = state::free;
};

/// One mapped run of an expandable segment: a physical handle mapped at `address`.
struct mapping_view {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  bool idle = false;  ///< no block touches its pages (cached memory, reclaimable)
};

/// One segment (a cudaMalloc'd range, or an expandable segment's virtual range) and its blocks,
/// which tile it in address order.
struct segment_view {
  std::uint64_t id = 0;  ///< creation order
  std::uintptr_t address = 0;
  std::size_t size = 0;
  bool small = false;       ///< of the small pool (blocks <= 1 MiB)
  bool expandable = false;  ///< a virtual range (its unmapped pages are in free blocks)
  stream_handle stream = nullptr;
  graph_pool_id pool{};  ///< the graph pool it belongs to; {0, 0} for ordinary memory
  /// The sleep domain (sleepable tag id) whose blocks alone it holds; 0 for none (sleep and wake).
  std::uint32_t sleep_domain = 0;
  bool asleep = false;  ///< its domain sleeps: no page of it is mapped
  std::vector<block_view> blocks;
  /// Expandable segments only: the physical page size, and the range's mapped runs (one per
  /// physical handle) in address order; the rest of the range is unmapped.
  std::size_t page_bytes = 0;
  std::vector<mapping_view> mappings;
};

/// The statistics and every segment, taken together under all locks (device_allocator::
/// take_snapshot): what snapshot_json() writes.
struct memory_snapshot {
  device_stats stats;
  /// By pool in creation order, each pool's segments newest first (segments() sorts by address).
  std::vector<segment_view> segments;
};

/// What a graph pool holds now (device_allocator::graph_pool_state).
struct graph_pool_info {
  bool exists = false;
  std::uint64_t uses = 0;           ///< owners not yet released (graphs, MemPools, the capture)
  bool routed = false;              ///< begin_allocate_to_pool without end_allocate_to_pool
  bool released = false;            ///< uses reached 0: its memory goes back to the device
  std::size_t reserved_bytes = 0;   ///< segments of the pool
  std::size_t allocated_bytes = 0;  ///< blocks of the pool handed out and not freed
  std::size_t retained_blocks = 0;  ///< blocks of other pools held for the graph (see below)
};

/// Decides whether an allocation on a stream goes to a graph pool (PyTorch's capture filter).
using stream_filter = std::function<bool(stream_handle)>;

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
  /// Attaches an observer to an allocator created without one (the registry does so when the
  /// program first sets a tag): it is told of the allocations and frees made from then on -- a
  /// free of a block allocated before is reported like any other. Safe while other threads
  /// allocate. Throws invalid_argument when `observer` is null or one is already attached.
  void attach_observer(std::shared_ptr<allocation_observer> observer);

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
    std::uintptr_t segment = 0;    ///< the base of the segment holding it (in_segment)
    std::size_t segment_size = 0;  ///< and that segment's size (PyTorch's getBaseAllocation)
  };
  [[nodiscard]] address_info locate(const void* ptr) const;
  /// What sharing a live allocation with another process needs (docs/design.md, "IPC").
  struct ipc_piece {
    phys_handle handle = 0;
    std::size_t bytes = 0;
  };
  struct ipc_block {
    bool expandable = false;
    std::uintptr_t base = 0;  ///< the segment's base, or (expandable) the first piece's address
    std::size_t span = 0;     ///< the segment's size, or (expandable) the pieces' total
    std::size_t offset = 0;   ///< ptr - base
    std::size_t size = 0;     ///< the block's size (as rounded)
    std::vector<ipc_piece> pieces;  ///< expandable: the handles mapped under the block, in order
  };
  /// The block `ptr` starts, for export; nullopt when ptr is not the start of a live allocation
  /// here. invalid_argument when it is a block of a sleeping domain (no memory to export). Takes
  /// every pool lock: not for hot paths.
  [[nodiscard]] std::optional<ipc_block> ipc_describe(const void* ptr) const;
  /// Marks the block `ptr` starts as exported (ipc_get_handle, once its handles are exported):
  /// its sleep domain then refuses to sleep while the block lives, since sleep would release
  /// the physical memory its importers map. invalid_argument, marking nothing, when the block's
  /// domain fell asleep meanwhile (or ptr is no live block). Takes every pool lock.
  void note_ipc_export(const void* ptr);
  /// Waits for pending frees, then returns every whole free segment to the device. While a graph
  /// capture is underway (one cucache knows of, below) the device must not be synchronized, and
  /// cudaFree does: it then throws cuda_error 900 (cudaErrorStreamCaptureUnsupported), having
  /// only polled pending frees.
  void empty_cache();

  // --- CUDA graphs (docs/design.md, "Graph capture") ------------------------------------------
  // An allocation on a stream that is being captured (capture_status) is served from a private
  // pool of that capture -- of_capture(capture id), or the pool a begin_allocate_to_pool route
  // gives it -- whose blocks only allocations routed to the same pool ever get: the graph keeps
  // using their addresses at every replay. Frees inside the capture return blocks to that pool;
  // a block of another pool that is freed, or was used, on a capturing stream is retained for the
  // graph (reused by nobody) until its pool is released. Pools are released by
  // release_graph_pool once no graph replays them; their memory then goes back to the device
  // after a device synchronization. While cucache knows of a capture (its first allocation, or
  // a route) it makes no call that is illegal during capture: device calls run in relaxed capture
  // mode, and nothing synchronizes the device (no cudaFree, no unmapping, no garbage collection).
  //
  // Announced captures (docs/design.md, "Announced captures"). By default every allocation on a
  // created stream or cudaStreamPerThread asks the driver whether the stream is being captured
  // (cuStreamGetCaptureInfo, ~30 ns on the H200). A front end that sees every capture begin and
  // end -- the PyTorch plug-in (PyTorch routes each capture with beginAllocateToPool) or the
  // LD_PRELOAD shim -- turns the captures-announced mode on and announces each capture; while no
  // announced capture, route or capture cucache knows of is active, an allocation on a created
  // stream then asks its id only. cudaStreamPerThread keeps its capture query in every mode.
  // Failure rule: a capture nobody announced is found by the driver's refusal of the capturing
  // stream's id (which invalidates that capture): the allocation throws cuda_error 901 naming the
  // capture, nothing is allocated, and the graph can never run.
  /// Turns the captures-announced mode on or off. Turn it on before any capture can begin.
  void set_captures_announced(bool on) noexcept;
  [[nodiscard]] bool captures_announced() const noexcept;
  /// A capture whose work may allocate on this device begins: allocations ask the capture
  /// status again until the matching announce_capture_end.
  void announce_capture_begin() noexcept;
  /// An announced capture has ended. Throws invalid_argument, changing nothing, when no
  /// announced capture is active.
  void announce_capture_end();
  /// Announced captures begun and not ended.
  [[nodiscard]] std::uint64_t announced_captures() const noexcept;
  /// Allocations refused because their stream was in a capture nobody announced (failure rule).
  [[nodiscard]] std::uint64_t unannounced_captures() const noexcept;
  //
  // Announced stream destructions (docs/design.md, "Announced stream destructions"). In the
  // captures-announced mode an allocation on a created stream still asks the driver for the
  // stream's id (cuStreamGetId, ~16 ns on the H200): the runtime hands a destroyed stream's handle
  // to the next stream it creates, and the id tells them apart. A front end that sees every
  // stream destruction of the process -- the LD_PRELOAD shim with CUCACHE_PRELOAD_STREAMS=announced
  // -- turns this mode on and announces each destruction before the driver performs it; each
  // thread then keeps the id of the stream it last allocated on, and a cache hit asks the driver
  // nothing. Only where the captures-announced mode is on and nothing may be capturing.
  // Contract: the front end must see every capture as well as every destruction. A cached id is
  // not asked again, so a capture nobody announced on that stream is not found (the failure rule
  // above rests on the id query), and a destruction nobody announced lets the next stream with
  // the dead one's handle allocate from the dead stream's pool, while its work may still run.
  /// Turns the stream-destructions-announced mode on or off. Turning it on trusts no id cached
  /// before.
  void set_stream_destructions_announced(bool on) noexcept;
  [[nodiscard]] bool stream_destructions_announced() const noexcept;
  /// A stream of the process is about to be destroyed: call before the driver destroys it. Every
  /// thread's cached id misses once, for every allocator of the process (one atomic increment).
  static void announce_stream_destruction() noexcept;
  /// Routes allocations on streams for which `filter` answers true to graph pool `pool`, creating
  /// the pool or adding an owner to it (PyTorch's beginAllocateToPool). Throws invalid_argument
  /// for {0, 0}, a null filter or a pool routed already.
  void begin_allocate_to_pool(graph_pool_id pool, stream_filter filter);
  /// Ends the route of `pool` (PyTorch's endAllocateToPool) or, for of_capture(id), tells cucache
  /// that capture has ended. Throws invalid_argument when neither applies.
  void end_allocate_to_pool(graph_pool_id pool);
  /// Drops one owner of `pool` (PyTorch's releasePool): with the last, the pool is released --
  /// its route and capture must have ended, and no graph that uses it may run again. Its free
  /// memory and the blocks retained for it go back after a device synchronization (now, or once
  /// no capture is underway); its live blocks when they are freed. Throws invalid_argument for an
  /// unknown pool, one without owners, or the last owner of one still routed.
  void release_graph_pool(graph_pool_id pool);
  /// The state of `pool` (exists == false when unknown).
  [[nodiscard]] graph_pool_info graph_pool_state(graph_pool_id pool) const;
  /// Adds an owner to `pool`, creating it with one (PyTorch's createOrIncrefPool: a MemPool, or a
  /// graph that shares a pool). A released pool is revived once it has settled (a device
  /// synchronization since its release). Throws invalid_argument for {0, 0} and for a released
  /// pool whose last graph may still replay (a capture kept cucache from synchronizing).
  void create_or_incref_graph_pool(graph_pool_id pool);
  /// Makes `pool` never split a block (PyTorch's MemPool(no_split=True)): a request it serves
  /// takes a free block whole, or a segment of its own size (2 MiB granules), so that every
  /// segment of the pool holds one block. Throws invalid_argument for an unknown pool.
  void set_graph_pool_no_split(graph_pool_id pool);
  /// Every live allocation of `pool`, by address (empty when the pool does not exist): what
  /// PyTorch's checkPoolLiveAllocations compares with the tensors it knows.
  [[nodiscard]] std::vector<void*> graph_pool_live_allocations(graph_pool_id pool) const;
  /// Gives `pool`'s wholly free segments back to the device after a device synchronization
  /// (PyTorch's emptyCache(mempool_id), torch.cuda.MemPool's empty_cache): the caller states that
  /// no graph will replay on that memory. Throws cuda_error 900 while a capture is underway and
  /// invalid_argument for an unknown pool.
  void empty_graph_pool_cache(graph_pool_id pool);

  /// A graph pool's layout at one moment, for PyTorch's cudagraph trees
  /// (getCheckpointState / setCheckpointPoolState): its segments and its live blocks.
  struct graph_pool_checkpoint {
    graph_pool_id pool;
    struct segment {
      std::uintptr_t address = 0;
      std::size_t size = 0;
      stream_handle stream = nullptr;
    };
    struct block {
      std::uintptr_t address = 0;
      std::size_t size = 0;       ///< as rounded
      std::size_t requested = 0;  ///< what the caller asked for
      stream_handle stream = nullptr;
    };
    std::vector<segment> segments;  ///< by address
    std::vector<block> live;        ///< by address
  };
  /// The layout of `pool` now. Throws invalid_argument for an unknown pool, and for one holding
  /// blocks freed but waiting for other streams (no layout to go back to while they wait).
  [[nodiscard]] graph_pool_checkpoint checkpoint_graph_pool(graph_pool_id pool) const;
  /// What restore_graph_pool did: the allocations it freed and those it made again.
  struct graph_pool_restored {
    std::vector<void*> freed;
    std::vector<graph_pool_checkpoint::block> allocated;
  };
  /// Puts `cp.pool` back in the layout of `cp`: every live allocation of the pool is freed (at
  /// once: the caller states that no queued work uses them), and every block live in `cp` is
  /// allocated again at its address, with its size and stream. Every segment of `cp` must still
  /// be the pool's (a pool keeps its segments while it has owners). Throws invalid_argument,
  /// changing nothing, for an unknown or released pool, a segment of `cp` the pool no longer has,
  /// or blocks of the pool that wait for other streams; cuda_error 900 is never thrown (nothing
  /// here calls the device).
  graph_pool_restored restore_graph_pool(const graph_pool_checkpoint& cp);

  // --- headroom and reserve (docs/api.md) -----------------------------------------------------
  /// The largest request on `stream` that allocate would serve now: from a cached free block of
  /// the stream's pool (best fit, max_split_size), or -- after the out-of-memory ladder would
  /// release every whole free segment, or, in expandable mode, unmap every idle page -- from new
  /// memory under the device's free memory and the memory limit. Waits for pending frees first
  /// (as the ladder does) and takes every pool lock: not for the hot path. Exact on the simulated
  /// device; on a GPU, other processes and the driver's own fragmentation may refuse less.
  /// While a CUDA graph capture is underway, for a stream that is not capturing.
  [[nodiscard]] std::size_t max_allocatable(stream_handle stream = nullptr);
  /// Caches `bytes` of free memory for `stream` now, so that the first requests make no device
  /// allocation: one large-pool segment of `bytes` rounded up to 2 MiB (requests of 1 MiB or
  /// less use the small pool and do not draw on it), or in expandable mode pages mapped at the
  /// front of the large range (idle until used; small requests may move them). Reserved memory is
  /// ordinary cached memory: it counts in reserved bytes, and empty_cache, the out-of-memory
  /// ladder and garbage collection may give it back like any free segment (docs/api.md). Throws
  /// out_of_memory when the device or the memory limit has no room.
  void reserve(std::size_t bytes, stream_handle stream = nullptr);

  /// Caps what this allocator may reserve at `fraction` (0 <= fraction <= 1) of the device's
  /// memory from now on, like CUCACHE_CONF's memory_fraction (the lower of it and
  /// memory_limit_mb wins) -- PyTorch's set_per_process_memory_fraction, at any time. 0 allows
  /// nothing more to be reserved. Memory reserved above a lowered cap is not given back here
  /// (empty_cache does that); no growth passes the cap. Throws invalid_argument for a fraction
  /// outside [0, 1].
  void set_memory_fraction(double fraction);
  /// The fraction set by set_memory_fraction or CUCACHE_CONF's memory_fraction; 1.0 when none was.
  [[nodiscard]] double memory_fraction() const noexcept;
  /// Changes the size rules from now on, as PyTorch's _set_allocator_settings does: `rules` is a
  /// configuration whose max_split_size, max_non_split_rounding, roundup_power2_divisions and
  /// garbage_collection_threshold take effect for every allocation after the call (cached
  /// blocks stay where they are; statistics' oversize counts follow the new max_split_size).
  /// Every other field must equal get_config()'s: invalid_argument naming the first key that
  /// differs (e.g. expandable_segments) otherwise, or a value parse_config refuses; nothing
  /// changes then. get_config() returns the new configuration afterwards. Takes every pool
  /// lock: safe while other threads allocate and free.
  void set_size_rules(const config& rules);

  // --- sleep and wake (expandable segments; docs/api.md "Sleep and wake") ---------------------
  // A sleep domain (1 .. 16383; the front ends give a sleepable tag's id) names the blocks
  // allocated while it was the allocating thread's domain (set_thread_sleep_domain). In
  // expandable mode they are placed in pools of their own (one per stream), so that no physical
  // page holds another domain's or an undomained block.
  /// Sets the calling thread's sleep domain (0: none) for the allocations it makes from now on.
  static void set_thread_sleep_domain(std::uint32_t domain);
  [[nodiscard]] static std::uint32_t thread_sleep_domain() noexcept;
  /// Releases the physical memory of every live block of `domain` and of its cached pages,
  /// keeping their virtual addresses: pointers stay valid, and no work may touch them until wake.
  /// With keep_contents the live blocks' bytes are first copied to pinned host memory (wake
  /// copies them back; the pinned buffer -- pinned ahead by prepare_sleep, or here -- is kept
  /// after wake for the domain's next sleep, and freed by a sleep without keep_contents or with
  /// the allocator). Pending frees of the domain and all queued work are waited for first
  /// (one device synchronization). Throws, changing nothing: cuda_error 801 (not expandable
  /// mode), invalid_argument (domain 0 or too large, already asleep, blocks held for a CUDA
  /// graph, a live block exported by ipc_get_handle: its importers map its physical memory),
  /// cuda_error 900 while a capture is underway, out_of_memory when the host cannot pin the copy.
  /// A device failure while unmapping (cuda_error) is rolled back: every page of the domain's
  /// live blocks is mapped again, their contents copied back when kept (without keep_contents
  /// the bytes of the pages already released are lost), and the domain stays awake; only if that
  /// fails too is the rest released, leaving the domain asleep (the message says which). Takes
  /// every pool lock for its duration.
  /// `label` names the domain in messages (the tag's name). `check`, when given, runs under every
  /// pool lock once the domain is known to be awake, with the requested bytes of the live blocks
  /// in the domain's pools; what it throws refuses the sleep, nothing changed (the front end
  /// compares them with its own count of the tag's bytes).
  void sleep(std::uint32_t domain, bool keep_contents, std::string_view label = {},
             const std::function<void(std::size_t placed_bytes)>& check = {});
  /// One domain of a sleep call over several (sleep(std::span)).
  struct sleep_request {
    std::uint32_t domain = 0;
    bool keep_contents = false;
    std::string_view label;  ///< names the domain in messages
    std::function<void(std::size_t placed_bytes)> check;  ///< as sleep's `check`
  };
  /// Puts several domains to sleep in one call (what an inference engine's sleep does: weights
  /// kept, KV cache dropped), under one take of every pool lock and with the device synchronized
  /// once for the whole call (twice when any contents are kept: before and after the copies,
  /// which are queued for every kept domain before that second synchronization). Every request
  /// is checked first, against the same refusals as sleep() plus a domain named twice; any
  /// refusal throws with nothing changed for any domain. A device failure while releasing the
  /// k-th domain's pages rolls that domain back as sleep() does; the domains before it stay
  /// asleep, those after it are left awake and untouched (their kept copies become their spare
  /// buffers), and the message names both. An empty list is invalid_argument.
  void sleep(std::span<const sleep_request> requests);
  /// Pins the host buffer the domain's next kept sleep copies into, ahead (docs/api.md, "Sleep
  /// and wake"): at least `bytes`, and at least the bytes of the domain's allocated blocks now
  /// (what a sleep with keep_contents would copy). Nothing is pinned when the domain's buffer
  /// (from an earlier prepare_sleep or kept sleep) is large enough already; a smaller one is
  /// replaced. The pinning (cudaHostAlloc: seconds for gigabytes) runs with no pool lock held,
  /// so other threads allocate and free meanwhile; call it once after loading the weights, or
  /// on a thread of your own. The buffer stays the domain's until a sleep without keep_contents,
  /// a later kept sleep that needs more (which pins a larger one), or the allocator's end.
  /// Returns the buffer's bytes (0 when the domain holds no allocated block and bytes is 0).
  /// Throws, changing nothing: cuda_error 801 (not expandable mode), invalid_argument (domain 0
  /// or too large, asleep), out_of_memory when the host cannot pin that much.
  std::size_t prepare_sleep(std::uint32_t domain, std::size_t bytes = 0,
                            std::string_view label = {});
  /// The bytes of the pinned buffer the domain keeps for its next kept sleep (0: none; while it
  /// sleeps with keep_contents, the buffer holding its contents is sleeping()'s host_bytes).
  [[nodiscard]] std::size_t sleep_buffer_bytes(std::uint32_t domain) const;
  /// Maps new physical memory under every page the domain's live blocks touch, at the same
  /// addresses, and copies the kept contents back. When the device or the memory limit lacks
  /// room it first makes room as the out-of-memory ladder does: waits for every pending
  /// (stream-ordered) free and gives back the other pools' idle pages. Throws, leaving the domain asleep and
  /// nothing of it mapped: invalid_argument (not asleep), out_of_memory naming how much was
  /// missing, cuda_error from the device.
  void wake(std::uint32_t domain, std::string_view label = {});
  /// One domain of a wake call over several.
  struct wake_request {
    std::uint32_t domain = 0;
    std::string_view label;  ///< names the domain in messages when its sleep gave none
  };
  /// Wakes several domains in one call, all or none: every domain must be asleep and named once
  /// (else invalid_argument, nothing changed); the room needed is that of all of them together
  /// (out_of_memory when short: all stay asleep, nothing of them mapped); the kept contents of
  /// every domain are copied back under one device synchronization; a failure maps none again.
  void wake(std::span<const wake_request> requests);
  /// A sleeping domain (sleeping()).
  struct sleep_state {
    std::uint32_t domain = 0;
    std::size_t bytes = 0;       ///< device bytes wake maps again (pages of live blocks)
    std::size_t host_bytes = 0;  ///< pinned host bytes holding the contents (keep_contents)
    double copy_seconds = 0;     ///< sleep's device-to-host copies, synchronization included
  };
  /// Seconds the last wake of `domain` spent copying its contents back (0 when none was kept).
  [[nodiscard]] double last_wake_copy_seconds(std::uint32_t domain) const;
  /// Every sleeping domain, by domain.
  [[nodiscard]] std::vector<sleep_state> sleeping() const;
  /// Whether `domain` is asleep.
  [[nodiscard]] bool is_asleep(std::uint32_t domain) const;
  /// The bytes callers asked for, of the live blocks in `domain`'s pools (requested_bytes).
  [[nodiscard]] std::size_t domain_requested_bytes(std::uint32_t domain) const;

  /// Statistics, taken consistently under all locks.
  [[nodiscard]] device_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  /// PyTorch-style text table of the statistics (see docs/api.md).
  [[nodiscard]] std::string memory_summary() const;
  /// JSON description of every segment and block (see docs/api.md).
  [[nodiscard]] std::string snapshot_json() const;
  /// Every segment and its blocks, taken consistently under all locks (what snapshots are made
  /// of: cucache::snapshot() writes them in PyTorch's memory-viewer schema).
  [[nodiscard]] std::vector<segment_view> segments() const;
  /// The statistics and every segment under one set of locks (consistent with each other).
  [[nodiscard]] memory_snapshot take_snapshot() const;
  /// Size of the block holding ptr (its rounded size) or 0 when ptr is not a live allocation.
  [[nodiscard]] std::size_t allocation_size(const void* ptr) const;

  /// Checks every structural invariant (blocks tile segments, no adjacent free blocks, the free
  /// index holds exactly the free blocks, stats equal a recount). Throws std::logic_error naming
  /// the first violation. For tests; takes all locks and walks everything, so it may run while
  /// other threads allocate and free (each changes a pool only under that pool's lock).
  void check_invariants() const;

  [[nodiscard]] const config& get_config() const noexcept;
  [[nodiscard]] int device() const noexcept;
  [[nodiscard]] device_backend& backend() const noexcept;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace cucache
