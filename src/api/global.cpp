// The C++ global API (cucache.hpp): a thin front end over the process registry.
#include "cucache/cucache.hpp"

#include "api/registry.hpp"

namespace cucache {

using detail::registry;
using detail::release_kind;

void* malloc(std::size_t bytes, stream_handle stream) {
  registry& r = registry::instance();
  return r.allocator(r.current_device()).allocate(bytes, stream);
}

namespace {

// free, free_async and record_stream: no registry means nothing was ever allocated, so the pointer
// cannot be ours; and none of them should fail on a bad environment that malloc already reported.
void release(void* ptr, stream_handle stream, release_kind kind) {
  registry* r = registry::if_built();
  if (r == nullptr) detail::throw_not_ours(ptr, kind);
  const int device = r->try_current_device();
  if (!r->release(ptr, stream, kind, device)) detail::throw_not_ours(ptr, kind, device);
}

}  // namespace

void free(void* ptr) {
  if (ptr == nullptr) return;
  release(ptr, nullptr, release_kind::plain);
}

void free_async(void* ptr, stream_handle stream) {
  if (ptr == nullptr) return;
  release(ptr, stream, release_kind::ordered);
}

void record_stream(void* ptr, stream_handle stream) {
  if (ptr == nullptr) detail::throw_not_ours(ptr, release_kind::record);
  release(ptr, stream, release_kind::record);
}

device_allocator& get(int device) {
  return registry::instance().allocator(device);
}

device_allocator& get() {
  registry& r = registry::instance();
  return r.allocator(r.current_device());
}

void empty_cache() {
  if (registry* r = registry::if_built()) r->empty_cache();
}

std::size_t max_allocatable(int device, stream_handle stream) {
  return get(device).max_allocatable(stream);
}

std::size_t max_allocatable() {
  return get().max_allocatable(nullptr);
}

void reserve(std::size_t bytes, int device, stream_handle stream) {
  get(device).reserve(bytes, stream);
}

void reserve(std::size_t bytes) {
  get().reserve(bytes, nullptr);
}

std::string memory_summary(int device) {
  return get(device).memory_summary();
}

void flush_trace() {
  if (registry* r = registry::if_built()) r->flush_trace();
}

}  // namespace cucache
