// The two devices the typed allocator suite (allocator_suite.cpp) runs on, behind one interface:
// the simulated device and a real GPU. Each says whether it can run here, opens a backend
// (optionally leaving only a given amount of device memory free, so that the device itself
// refuses an allocation), hands out streams, keeps a stream busy until told, and lets every
// stream catch up. The tests are written once against this interface; what differs between the
// devices lives here and nowhere else:
//
//   - streams: fake handles on the simulated device, real non-blocking streams on the GPU;
//   - work on a stream: the simulated device's events complete only when the test says so; a
//     real stream finishes its work by itself, so `hold` queues a host function that blocks the
//     stream until `complete_all` (or a deadline) opens it;
//   - a small device: the simulated device is given that capacity; on the GPU the rest of the
//     device's free memory is taken by a ballast of plain cudaMalloc memory, outside the
//     allocator under test;
//   - the driver's page: the GPU's free memory moves in whole pages of the VM granularity, so
//     comparisons against its free-memory figure allow one page per device allocation.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cucache/backend.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/sim_backend.hpp"

namespace cucache::test {

/// How long a held stream stays busy when nobody opens it: long enough that no test step can
/// outlast it, short enough that a test that forgets to open it is slow rather than hung.
inline constexpr std::chrono::milliseconds k_hold_forever{10'000};

class sim_device {
 public:
  static constexpr const char* name = "sim";
  /// Why this device cannot run here ("" when it can).
  static std::string unavailable() { return {}; }
  static std::size_t granularity() { return sim_options{}.granularity_bytes; }

  /// A fresh backend. `leave_free` > 0: a device of that capacity (all of it free).
  std::shared_ptr<device_backend> open(std::size_t leave_free) {
    sim_options o;
    if (leave_free != 0) o.capacity_bytes = leave_free;
    sim_ = std::make_shared<sim_backend>(o);
    return sim_;
  }
  /// Stream `i` (0 is the legacy default stream, nullptr).
  [[nodiscard]] stream_handle stream(int i) const {
    return i == 0 ? nullptr : reinterpret_cast<stream_handle>(static_cast<std::uintptr_t>(i) << 8);
  }
  /// Keeps `s` busy: work recorded on it from now on is not complete until complete_all() (or,
  /// on the GPU, until `open_after`). On the simulated device every event is pending until the
  /// test completes it, and synchronizing on one completes it: nothing to do.
  void hold(stream_handle /*s*/, std::chrono::milliseconds /*open_after*/ = k_hold_forever) {}
  /// Every stream catches up: every event recorded so far has completed.
  void complete_all() { sim_->complete_all(); }
  /// The CUDA runtime's error slot is clean (the simulated device has none).
  [[nodiscard]] bool runtime_error_clear() const { return true; }
  /// Bytes by which the device's free-memory figure may differ from the allocator's reservation
  /// per device allocation: the simulated device counts exactly.
  [[nodiscard]] static std::size_t slack_per_allocation() { return 0; }
  void release_all() {}

 private:
  std::shared_ptr<sim_backend> sim_;
};

class cuda_device {
 public:
  static constexpr const char* name = "cuda";
  static std::string unavailable() {
    return cuda_available() ? std::string() : cuda_unavailable_reason();
  }
  static std::size_t granularity() {
    static const std::size_t g = cuda_backend(0).vm_granularity();
    return g;
  }

  cuda_device() {
    // Created before any measurement of free memory: a stream may take some device memory.
    for (cudaStream_t& s : streams_) {
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
  }
  ~cuda_device() {
    release_all();
    for (cudaStream_t s : streams_) {
      if (s != nullptr) static_cast<void>(cudaStreamDestroy(s));
    }
  }
  cuda_device(const cuda_device&) = delete;
  cuda_device& operator=(const cuda_device&) = delete;

  std::shared_ptr<device_backend> open(std::size_t leave_free) {
    auto backend = std::make_shared<cuda_backend>(0);  // initializes the context first
    if (leave_free != 0) take_all_but(leave_free);
    return backend;
  }
  [[nodiscard]] stream_handle stream(int i) const {
    if (i == 0) return nullptr;
    return streams_.at(static_cast<std::size_t>(i - 1));
  }
  void hold(stream_handle s, std::chrono::milliseconds open_after = k_hold_forever) {
    auto g = std::make_unique<gate>();
    g->deadline = std::chrono::steady_clock::now() + open_after;
    check(cudaLaunchHostFunc(static_cast<cudaStream_t>(s), &gate::wait, g.get()),
          "cudaLaunchHostFunc");
    gates_.push_back(std::move(g));
  }
  void complete_all() {
    open_gates();
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  [[nodiscard]] bool runtime_error_clear() const { return cudaGetLastError() == cudaSuccess; }
  /// The driver maps device memory in pages of the VM granularity (2 MiB on current GPUs).
  [[nodiscard]] static std::size_t slack_per_allocation() {
    return std::max<std::size_t>(granularity(), std::size_t{2} << 20);
  }
  /// Opens every gate, waits for the device and gives the ballast back.
  void release_all() {
    open_gates();
    static_cast<void>(cudaDeviceSynchronize());
    gates_.clear();
    for (void* p : ballast_) static_cast<void>(cudaFree(p));
    ballast_.clear();
  }

 private:
  // A host function queued on a stream that blocks it until opened or until its deadline.
  struct gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    std::chrono::steady_clock::time_point deadline;
    static void CUDART_CB wait(void* self) {
      auto* g = static_cast<gate*>(self);
      std::unique_lock lock(g->mu);
      g->cv.wait_until(lock, g->deadline, [g] { return g->open; });
    }
  };

  static void check(cudaError_t code, const char* call) {
    if (code != cudaSuccess) {
      throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(code));
    }
  }

  void open_gates() {
    for (auto& g : gates_) {
      {
        std::lock_guard lock(g->mu);
        g->open = true;
      }
      g->cv.notify_all();
    }
  }

  // Takes device memory with cudaMalloc until about `want` bytes remain free.
  void take_all_but(std::size_t want) {
    constexpr std::size_t page = std::size_t{2} << 20;
    for (int pass = 0; pass < 2; ++pass) {
      std::size_t free = 0;
      std::size_t total = 0;
      check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
      if (pass == 0 && free < want) {
        throw std::runtime_error("the device has only " + std::to_string(free) +
                                 " bytes free; the test needs " + std::to_string(want));
      }
      std::size_t rest = free > want ? (free - want) / page * page : 0;
      std::size_t chunk = std::size_t{1} << 30;
      while (rest != 0) {
        chunk = std::min(chunk, rest);
        void* p = nullptr;
        if (cudaMalloc(&p, chunk) == cudaSuccess) {
          ballast_.push_back(p);
          rest -= chunk;
        } else {
          static_cast<void>(cudaGetLastError());
          if (chunk == page) break;
          chunk = std::max(page, chunk / 2 / page * page);
        }
      }
    }
    std::size_t free = 0;
    std::size_t total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    if (free + page < want || free > want + page) {
      throw std::runtime_error("could not leave " + std::to_string(want) +
                               " bytes free on the device: " + std::to_string(free) + " are");
    }
  }

  std::array<cudaStream_t, 4> streams_{};
  std::vector<std::unique_ptr<gate>> gates_;
  std::vector<void*> ballast_;
};

}  // namespace cucache::test
