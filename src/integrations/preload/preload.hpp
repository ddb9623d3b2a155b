// The routing of libcucache_preload.so (docs/preload.md), apart from the symbols it exports: which
// driver call cucache answers, which it forwards to the real driver, and which it refuses. Every
// function here takes the real driver as a table of entry points, so the tests drive it over the
// simulated device with a fake driver, without libcuda.
//
// The driver's types are spelled here rather than taken from cuda.h: the exported functions carry
// the driver's own names (cuMemAlloc_v2, ...), which cuda.h declares, and its macros rename.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cucache::preload {

using cu_result = int;                     // CUresult
using cu_deviceptr = unsigned long long;   // CUdeviceptr (v2)
using cu_stream = struct CUstream_st*;     // CUstream
using cu_mem_handle = unsigned long long;  // CUmemGenericAllocationHandle
using cu_mem_pool = struct CUmemPoolHandle_st*;  // CUmemoryPool
using cu_device = int;                     // CUdevice
using cu_graph = struct CUgraph_st*;       // CUgraph
using cu_graph_node = struct CUgraphNode_st*;  // CUgraphNode

inline constexpr cu_result k_success = 0;           // CUDA_SUCCESS
inline constexpr cu_result k_invalid_value = 1;     // CUDA_ERROR_INVALID_VALUE
inline constexpr cu_result k_out_of_memory = 2;     // CUDA_ERROR_OUT_OF_MEMORY
inline constexpr cu_result k_not_initialized = 3;   // CUDA_ERROR_NOT_INITIALIZED
inline constexpr cu_result k_no_device = 100;       // CUDA_ERROR_NO_DEVICE
inline constexpr cu_result k_invalid_device = 101;  // CUDA_ERROR_INVALID_DEVICE
inline constexpr cu_result k_not_found = 500;       // CUDA_ERROR_NOT_FOUND
inline constexpr cu_result k_not_supported = 801;   // CUDA_ERROR_NOT_SUPPORTED
inline constexpr cu_result k_unknown = 999;         // CUDA_ERROR_UNKNOWN
/// CU_STREAM_PER_THREAD: what stream 0 means to a _ptsz entry point.
inline const cu_stream k_stream_per_thread = reinterpret_cast<cu_stream>(std::uintptr_t{2});

/// The real driver's entry points the routing forwards to. A null entry answers k_not_found.
struct real_driver {
  cu_result (*mem_alloc)(cu_deviceptr*, std::size_t) = nullptr;
  cu_result (*mem_free)(cu_deviceptr) = nullptr;
  cu_result (*mem_alloc_async)(cu_deviceptr*, std::size_t, cu_stream) = nullptr;
  cu_result (*mem_free_async)(cu_deviceptr, cu_stream) = nullptr;
  cu_result (*mem_alloc_async_ptsz)(cu_deviceptr*, std::size_t, cu_stream) = nullptr;
  cu_result (*mem_free_async_ptsz)(cu_deviceptr, cu_stream) = nullptr;
  cu_result (*mem_alloc_pitch)(cu_deviceptr*, std::size_t*, std::size_t, std::size_t,
                               unsigned int) = nullptr;
  cu_result (*mem_get_info)(std::size_t*, std::size_t*) = nullptr;
  cu_result (*ipc_get_mem_handle)(void*, cu_deviceptr) = nullptr;
  cu_result (*mem_get_address_range)(cu_deviceptr*, std::size_t*, cu_deviceptr) = nullptr;
  cu_result (*ctx_synchronize)() = nullptr;
  cu_result (*mem_retain_allocation_handle)(cu_mem_handle*, void*) = nullptr;
  cu_result (*mem_alloc_from_pool_async)(cu_deviceptr*, std::size_t, cu_mem_pool,
                                         cu_stream) = nullptr;
  cu_result (*mem_alloc_from_pool_async_ptsz)(cu_deviceptr*, std::size_t, cu_mem_pool,
                                              cu_stream) = nullptr;
  cu_result (*ctx_get_device)(cu_device*) = nullptr;
  cu_result (*device_get_default_mem_pool)(cu_mem_pool*, cu_device) = nullptr;
  // The capture calls (CUDA 10.1's cuStreamBeginCapture_v2 signature; _ptsz: per-thread stream).
  cu_result (*stream_begin_capture)(cu_stream, int) = nullptr;
  cu_result (*stream_begin_capture_ptsz)(cu_stream, int) = nullptr;
  cu_result (*stream_begin_capture_to_graph)(cu_stream, cu_graph, const cu_graph_node*,
                                             const void*, std::size_t, int) = nullptr;
  cu_result (*stream_begin_capture_to_graph_ptsz)(cu_stream, cu_graph, const cu_graph_node*,
                                                  const void*, std::size_t, int) = nullptr;
  cu_result (*stream_end_capture)(cu_stream, cu_graph*) = nullptr;
  cu_result (*stream_end_capture_ptsz)(cu_stream, cu_graph*) = nullptr;
  cu_result (*stream_is_capturing)(cu_stream, int*) = nullptr;
  cu_result (*stream_is_capturing_ptsz)(cu_stream, int*) = nullptr;
  // The stream destructions: cuStreamDestroy_v2 (CUDA 4.0's, what cuStreamDestroy names in cuda.h
  // and what cuGetProcAddress answers from ABI 4000) and the older cuStreamDestroy it replaced.
  cu_result (*stream_destroy)(cu_stream) = nullptr;
  cu_result (*stream_destroy_v2)(cu_stream) = nullptr;
};

/// What a plain free (cuMemFree, so cudaFree) does before the block is reused.
enum class free_mode : std::uint8_t {
  sync,    ///< CUCACHE_PRELOAD_FREE=sync (default): synchronize the context, as cudaFree does, so
           ///< memory freed while other streams still use it is reused only after they finished
  stream,  ///< CUCACHE_PRELOAD_FREE=stream: reusable at once on its allocation stream (cucache's
           ///< and PyTorch's rule; fast, but a program that frees memory in use on another stream
           ///< without synchronizing first would see it reused under that stream's feet)
};

/// Whether the shim announces the program's graph captures to cucache (docs/preload.md,
/// "Captures"). CUCACHE_PRELOAD_CAPTURES.
enum class captures_mode : std::uint8_t {
  announced,  ///< default: every capture begin and end passes through the shim, which announces
              ///< it, and an allocation on a created stream skips the driver's capture query
              ///< while none is underway (device_allocator::set_captures_announced)
  query,      ///< CUCACHE_PRELOAD_CAPTURES=query: announce nothing; every allocation on a created
              ///< stream asks the driver whether the stream is capturing
};

/// Whether the allocators trust the stream destructions the shim announces (docs/preload.md,
/// "Stream destructions"). CUCACHE_PRELOAD_STREAMS. The shim announces every cuStreamDestroy
/// either way; the mode says whether the allocators may rely on it.
enum class streams_mode : std::uint8_t {
  query,      ///< default: every allocation on a created stream asks the driver its id
  announced,  ///< CUCACHE_PRELOAD_STREAMS=announced, with CUCACHE_PRELOAD_CAPTURES=announced only:
              ///< each thread caches the id of the stream it last allocated on, valid until
              ///< the shim announces a destruction (set_stream_destructions_announced)
};

/// Counters of what the routing did, for the exit report and the tests.
struct counters {
  std::atomic<std::uint64_t> allocations{0};      ///< answered by cucache
  std::atomic<std::uint64_t> pool_allocations{0};  ///< of those, from a default memory pool
  std::atomic<std::uint64_t> forwarded_pool_allocations{0};  ///< other pools, given to the driver
  std::atomic<std::uint64_t> frees{0};            ///< of cucache memory
  std::atomic<std::uint64_t> forwarded_frees{0};  ///< foreign pointers given to the driver
  std::atomic<std::uint64_t> bad_frees{0};        ///< refused: inside cucache memory, not live
  std::atomic<std::uint64_t> refused{0};          ///< IPC handles of cucache memory
  std::atomic<std::uint64_t> address_ranges{0};   ///< cuMemGetAddressRange on cucache memory
  std::atomic<std::uint64_t> captures{0};         ///< captures begun and announced by the shim
  std::atomic<std::uint64_t> stream_destructions{0};  ///< cuStreamDestroy calls announced
};
[[nodiscard]] counters& stats() noexcept;

/// CUCACHE_PRELOAD_CAPTURES (announced | query; unset or empty: announced). Throws
/// environment_error naming the value otherwise.
[[nodiscard]] captures_mode captures_mode_from_env();
/// The mode the routing uses, read once from the environment (a bad value is named on stderr and
/// query used: the safe side). Tests may set it before the first allocation.
void set_captures_mode(captures_mode mode) noexcept;

/// CUCACHE_PRELOAD_STREAMS (announced | query; unset or empty: query). Throws environment_error
/// naming the value otherwise.
[[nodiscard]] streams_mode streams_mode_from_env();
/// The mode the routing uses, read once from the environment (a bad value is named on stderr and
/// query used). It takes effect only with the captures-announced mode: the allocators are told
/// announced && captures announced. Tests may set it before the first allocation.
void set_streams_mode(streams_mode mode) noexcept;

/// CUCACHE_PRELOAD_FREE, read once. Throws environment_error on a value that is not sync/stream.
[[nodiscard]] free_mode free_mode_from_env();

// The interposed calls. Each catches everything and answers the driver's error codes; cucache's
// message also goes to stderr with a "cucache preload:" prefix.
cu_result mem_alloc(const real_driver& real, cu_deviceptr* dptr, std::size_t bytes,
                    cu_stream stream) noexcept;
/// cuMemAllocFromPoolAsync (`ptsz`: the _ptsz variant). An allocation from the *default* memory
/// pool of the context's device is what cuMemAllocAsync does, and cucache answers it as it answers
/// cuMemAllocAsync (XLA's cuda_async allocator, the CUDA runtime's cudaMallocFromPoolAsync on
/// cudaDeviceGetDefaultMemPool). Any other pool -- one the program created, or the default pool of
/// another device -- is the program's own object, with its own release threshold, access and
/// export rules: forwarded to the driver. Also forwarded when the driver cannot say which pool is
/// the default (no current context, a driver without the entry points).
cu_result mem_alloc_from_pool_async(const real_driver& real, cu_deviceptr* dptr, std::size_t bytes,
                                    cu_mem_pool pool, cu_stream stream, bool ptsz) noexcept;
cu_result mem_alloc_pitch(const real_driver& real, cu_deviceptr* dptr, std::size_t* pitch,
                          std::size_t width, std::size_t height, unsigned int element) noexcept;
/// cuMemFree. `mode` as free_mode_from_env() unless a test says otherwise. In a child forked after
/// the parent used cucache, every free (cuMemFreeAsync's too) fails with k_not_initialized and
/// the fork named on stderr: never forwarded to the driver (docs/design.md, "Fork and process
/// exit").
cu_result mem_free(const real_driver& real, cu_deviceptr dptr, free_mode mode) noexcept;
/// cuMemFreeAsync (`ptsz`: the _ptsz variant, whose stream 0 is the per-thread stream).
cu_result mem_free_async(const real_driver& real, cu_deviceptr dptr, cu_stream stream,
                         bool ptsz) noexcept;
cu_result mem_get_info(const real_driver& real, std::size_t* free, std::size_t* total) noexcept;

/// cuStreamBeginCapture_v2 (`ptsz`: its _ptsz variant). In the announced mode the capture is
/// announced to every device's allocator *before* the driver begins it (so an allocation on the
/// stream from another thread, the moment it is capturing, already asks the capture status), and
/// the announcement is withdrawn if the driver refuses to begin. In the query mode: forwarded.
cu_result stream_begin_capture(const real_driver& real, cu_stream stream, int mode,
                               bool ptsz) noexcept;
/// cuStreamBeginCaptureToGraph (CUDA 12.3), as stream_begin_capture.
cu_result stream_begin_capture_to_graph(const real_driver& real, cu_stream stream, cu_graph graph,
                                        const cu_graph_node* dependencies, const void* edge_data,
                                        std::size_t count, int mode, bool ptsz) noexcept;
/// cuStreamEndCapture. The announcement of a capture this shim announced is withdrawn once the
/// stream no longer captures (asked of cuStreamIsCapturing after the driver's answer: an end
/// refused -- from the wrong thread, say -- leaves the capture, and its announcement, in place).
cu_result stream_end_capture(const real_driver& real, cu_stream stream, cu_graph* graph,
                             bool ptsz) noexcept;
/// cuStreamDestroy (`v2`: cuStreamDestroy_v2). The destruction is announced to cucache first
/// (device_allocator::announce_stream_destruction: one atomic increment, whatever the mode), then
/// the driver's function destroys the stream; its answer is returned.
cu_result stream_destroy(const real_driver& real, cu_stream stream, bool v2) noexcept;
/// Captures announced by this shim and not yet ended (for the tests and the exit report).
[[nodiscard]] std::uint64_t announced_capture_count() noexcept;
cu_result ipc_get_mem_handle(const real_driver& real, void* handle, cu_deviceptr dptr) noexcept;
/// cuMemRetainAllocationHandle: on cucache memory, CUDA_ERROR_INVALID_VALUE, the driver's answer
/// for memory that no cuMemCreate mapping backs. In expandable mode cucache's pages are such
/// mappings, and a caller holding the handle would unmap and release them under cucache (XLA's
/// StreamExecutor asks it of every pointer it frees, to tell its own VMM memory from cuMemAlloc's).
/// Anything else is the driver's.
cu_result mem_retain_allocation_handle(const real_driver& real, cu_mem_handle* handle,
                                       void* addr) noexcept;
/// cuMemGetAddressRange: for an address inside a live cucache allocation, that allocation's start
/// and size (its block, as rounded: at least the size asked for), as the driver answers for its
/// own allocations; k_not_found inside cucache memory that is not a live allocation; anything
/// else is the driver's.
cu_result mem_get_address_range(const real_driver& real, cu_deviceptr* base, std::size_t* size,
                                cu_deviceptr dptr) noexcept;

/// cuMemAllocPitch's pitch for a row of `width` bytes (the driver's 512-byte alignment).
[[nodiscard]] std::size_t pitch_for(std::size_t width) noexcept;
/// The driver error code for a CUDA runtime error code cucache produced.
[[nodiscard]] cu_result driver_code(int runtime_code) noexcept;

/// The exit report (CUCACHE_REPORT=PATH|stderr): counters and every used device's memory_summary.
[[nodiscard]] std::string report_text();
/// Where CUCACHE_REPORT=`setting` puts the report of process `pid`: every "%p" becomes the pid
/// (one report per process of a tree that inherits the variable), "stderr" stays.
[[nodiscard]] std::string report_path(std::string_view setting, long pid);
/// Whether this process used cucache (an allocation or cuMemGetInfo reached it); set by
/// arm_exit_report().
[[nodiscard]] bool used_cucache() noexcept;
/// The stderr line of a process that never used cucache while CUCACHE_REPORT asked for a report:
/// that nothing reached cucache, and why (`driver_loaded`: whether libcuda.so.1 is in the process;
/// `sim`: CUCACHE_BACKEND=sim).
[[nodiscard]] std::string nothing_reached_text(bool driver_loaded, bool sim);
/// Registers, once, the exit handler that writes report_text() where CUCACHE_REPORT says and
/// flushes the trace; a child forked after the handler was registered writes nothing. Called after
/// the registry is built, so it runs before the registry's own exit handler empties the cache.
void arm_exit_report() noexcept;

}  // namespace cucache::preload
