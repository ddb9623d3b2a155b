// The device as the allocator calls it: every call that is not stream-ordered (cudaMalloc,
// cudaFree, the virtual-memory calls, event queries, memory info, synchronizations) runs with the
// calling thread in relaxed capture mode and its own mode restored afterwards. In global mode the
// runtime refuses such calls -- and invalidates the capture -- whenever any thread captures a
// stream; they are cucache's bookkeeping, never part of the captured work, so relaxed mode is
// their right mode (PyTorch does the same for the cudaMalloc of a capture's private pool). What
// relaxed mode does not permit -- synchronizing the device or a capturing stream, querying an
// event recorded in a capture -- the allocator itself never does while it knows of a capture.
#pragma once

#include <memory>
#include <utility>

#include "cucache/backend.hpp"

namespace cucache::detail {

class capture_safe_backend final : public device_backend {
 public:
  explicit capture_safe_backend(std::shared_ptr<device_backend> inner) : inner_(std::move(inner)) {}

  [[nodiscard]] int device() const noexcept override { return inner_->device(); }
  [[nodiscard]] const char* name() const noexcept override { return inner_->name(); }

  [[nodiscard]] void* segment_malloc(std::size_t bytes) override {
    const relaxed r(*inner_);
    return inner_->segment_malloc(bytes);
  }
  void segment_free(void* ptr) override {
    const relaxed r(*inner_);
    inner_->segment_free(ptr);
  }
  [[nodiscard]] std::size_t vm_granularity() override { return inner_->vm_granularity(); }
  [[nodiscard]] void* va_reserve(std::size_t bytes) override {
    const relaxed r(*inner_);
    return inner_->va_reserve(bytes);
  }
  void va_free(void* base, std::size_t bytes) override {
    const relaxed r(*inner_);
    inner_->va_free(base, bytes);
  }
  [[nodiscard]] std::optional<phys_handle> phys_create(std::size_t bytes) override {
    const relaxed r(*inner_);
    return inner_->phys_create(bytes);
  }
  void phys_release(phys_handle handle) override {
    const relaxed r(*inner_);
    inner_->phys_release(handle);
  }
  void map(void* va, std::size_t bytes, phys_handle handle) override {
    const relaxed r(*inner_);
    inner_->map(va, bytes, handle);
  }
  void unmap(void* va, std::size_t bytes) override {
    const relaxed r(*inner_);
    inner_->unmap(va, bytes);
  }
  void set_access(void* va, std::size_t bytes) override {
    const relaxed r(*inner_);
    inner_->set_access(va, bytes);
  }
  void configure_peer_access(peer_access_mode mode) override {
    inner_->configure_peer_access(mode);
  }
  [[nodiscard]] std::vector<int> access_devices() override { return inner_->access_devices(); }
  void enable_phys_export() override { inner_->enable_phys_export(); }
  [[nodiscard]] segment_ipc_handle segment_export(void* base) override {
    return inner_->segment_export(base);
  }
  [[nodiscard]] void* segment_import(const segment_ipc_handle& handle) override {
    const relaxed r(*inner_);
    return inner_->segment_import(handle);
  }
  void segment_close(void* base) override {
    const relaxed r(*inner_);
    inner_->segment_close(base);
  }
  [[nodiscard]] int phys_export_fd(phys_handle handle) override {
    return inner_->phys_export_fd(handle);
  }
  [[nodiscard]] phys_handle phys_import_fd(int fd) override { return inner_->phys_import_fd(fd); }
  [[nodiscard]] event_handle event_create() override { return inner_->event_create(); }
  void event_destroy(event_handle event) override { inner_->event_destroy(event); }
  void event_record(event_handle event, stream_handle stream) override {
    inner_->event_record(event, stream);
  }
  [[nodiscard]] bool event_query(event_handle event) override {
    const relaxed r(*inner_);
    return inner_->event_query(event);
  }
  void event_synchronize(event_handle event) override {
    const relaxed r(*inner_);
    inner_->event_synchronize(event);
  }
  void stream_synchronize(stream_handle stream) override {
    const relaxed r(*inner_);
    inner_->stream_synchronize(stream);
  }
  void device_synchronize() override {
    const relaxed r(*inner_);
    inner_->device_synchronize();
  }
  [[nodiscard]] memory_info mem_get_info() override {
    const relaxed r(*inner_);
    return inner_->mem_get_info();
  }
  [[nodiscard]] std::uint64_t stream_id(stream_handle stream) override {
    return inner_->stream_id(stream);
  }
  [[nodiscard]] capture_info capture_status(stream_handle stream) override {
    return inner_->capture_status(stream);
  }
  [[nodiscard]] stream_identity identify(stream_handle stream) override {
    return inner_->identify(stream);
  }
  capture_mode exchange_capture_mode(capture_mode mode) override {
    return inner_->exchange_capture_mode(mode);
  }

 private:
  /// The calling thread in relaxed mode for one call. Exchanging the mode is a thread-local
  /// setting that does not fail on a working runtime; if restoring it fails there is nothing a
  /// destructor could do, and the thread stays relaxed (more permissive, never less safe).
  class relaxed {
   public:
    explicit relaxed(device_backend& b)
        : b_(b), previous_(b.exchange_capture_mode(capture_mode::relaxed)) {}
    ~relaxed() {
      try {
        b_.exchange_capture_mode(previous_);
      } catch (...) {
      }
    }
    relaxed(const relaxed&) = delete;
    relaxed& operator=(const relaxed&) = delete;

   private:
    device_backend& b_;
    capture_mode previous_;
  };

  std::shared_ptr<device_backend> inner_;
};

}  // namespace cucache::detail
