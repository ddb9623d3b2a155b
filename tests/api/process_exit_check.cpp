// A whole program over the global C API, run by ctest in both modes (CUCACHE_BACKEND=sim, with and
// without CUCACHE_CONF=expandable_segments:True): it allocates on streams, frees, destroys the
// streams, empties the cache, leaves idle memory of destroyed streams behind and returns from main.
// cucache's exit handler then empties the cache again. Exit code 0 only when every call succeeded
// and the exit handler gave every byte back to the device without touching a destroyed stream;
// another code names what went wrong (the simulated device rejects destroyed streams as the driver
// does, where a real program crashed with SIGSEGV after main returned).
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/sim_backend.hpp"

namespace {

cucache::sim_backend* g_sim = nullptr;

// Registered before cucache's own handler, so it runs after it (atexit order is LIFO).
void check_after_cucache_exit_handler() {
  if (g_sim == nullptr) return;
  const std::size_t used = g_sim->used_bytes();
  const std::uint64_t dead = g_sim->destroyed_stream_calls();
  if (used != 0 || dead != 0) {
    std::fprintf(stderr,
                 "process_exit_check: after the exit handler the device still holds %zu bytes; "
                 "%llu calls named a destroyed stream\n",
                 used, static_cast<unsigned long long>(dead));
    std::fflush(stderr);
    std::_Exit(3);
  }
}

bool ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "process_exit_check: %s: error %d: %s\n", what, static_cast<int>(err),
               cucacheGetLastErrorMessage());
  return false;
}

// Allocates and frees on a fresh stream, then destroys it; `record` also uses a second stream.
bool use_and_destroy_a_stream(std::size_t bytes, bool record) {
  auto* s = static_cast<cudaStream_t>(g_sim->create_stream());
  auto* other = static_cast<cudaStream_t>(g_sim->create_stream());
  void* p = nullptr;
  if (!ok(cucacheMallocAsync(&p, bytes, s), "cucacheMallocAsync")) return false;
  if (record && !ok(cucacheRecordStream(p, other), "cucacheRecordStream")) return false;
  if (!ok(cucacheFreeAsync(p, s), "cucacheFreeAsync")) return false;
  g_sim->destroy_stream(other);
  g_sim->destroy_stream(s);
  return true;
}

}  // namespace

int main() {
  if (std::atexit(check_after_cucache_exit_handler) != 0) return 10;
  try {
    g_sim = dynamic_cast<cucache::sim_backend*>(&cucache::get(0).backend());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "process_exit_check: %s\n", e.what());
    return 11;
  }
  if (g_sim == nullptr) {
    std::fprintf(stderr, "process_exit_check: needs CUCACHE_BACKEND=sim\n");
    return 12;
  }
  // The program: 4 KiB, 8 MiB, 64 MiB on a stream destroyed before cucacheEmptyCache.
  for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{8} << 20, std::size_t{64} << 20}) {
    if (!use_and_destroy_a_stream(bytes, false)) return 1;
  }
  if (!use_and_destroy_a_stream(std::size_t{8} << 20, true)) return 1;
  if (!ok(cucacheEmptyCache(), "cucacheEmptyCache")) return 2;

  // Eight threads with their own streams, an alloc/free loop each, then destroyed.
  std::vector<std::thread> threads;
  std::vector<int> failed(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &failed] {
      for (int i = 0; i < 20; ++i) {
        if (!use_and_destroy_a_stream(
                (std::size_t{1} + static_cast<std::size_t>((t + i) % 5)) << 20, i % 4 == 0)) {
          failed[static_cast<std::size_t>(t)] = 1;
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int f : failed) {
    if (f != 0) return 4;
  }
  // Idle memory of destroyed streams is left for the exit handler.
  return 0;
}
