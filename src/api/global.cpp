// The C++ global API (cucache.hpp): a thin front end over the process registry.
#include "cucache/cucache.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "api/registry.hpp"
#include "observe/observe_hub.hpp"

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
  std::string text = get(device).memory_summary();
  const std::vector<tag_stat> tags = tag_stats(device);
  if (!tags.empty()) {
    // The tags' table follows PyTorch's, in its frame: requested bytes of live allocations.
    text += fmt::format("|{:^75}|\n", "Tags (requested bytes)");
    text += fmt::format("| {:<30}| {:>10} | {:>10} | {:>8} | {:>6} |\n", "tag", "current",
                        "peak", "live", "total");
    for (const tag_stat& t : tags) {
      text += fmt::format("| {:<30.30}| {:>10} | {:>10} | {:>8} | {:>6} |\n", t.tag,
                          t.current_bytes, t.peak_bytes, t.allocations, t.total_allocations);
    }
    text += fmt::format("|{:=^75}|\n", "");
  }
  return text;
}

// --- snapshots, leak hunting, tags (observe.hpp) -----------------------------------------------

std::string snapshot() {
  return registry::instance().torch_snapshot();
}

void write_snapshot(const std::filesystem::path& path) {
  const std::string text = snapshot();
  detail::write_file_replacing(path, text, "write_snapshot");
}

void mark_step() {
  registry::instance().hub().mark_step();
}

std::vector<leak_candidate> leak_report(std::uint64_t steps) {
  return registry::instance().hub().leak_report(steps);
}

std::string leak_report_json(std::uint64_t steps) {
  return detail::leak_report_json(registry::instance().hub(), steps);
}

void push_tag(std::string_view tag) {
  const std::uint32_t id = detail::tag_id(tag);
  registry::instance().activate_observers();  // allocators pay for observing only from now on
  detail::push_tag_id(id);
}

void pop_tag() {
  detail::pop_tag_id("pop_tag");
}

std::string current_tag() {
  return detail::tag_name(detail::current_tag_id());
}

std::vector<tag_stat> tag_stats(int device) {
  registry& r = registry::instance();
  if (r.find(device) == nullptr) return {};
  return r.hub().tag_stats(device);
}

tag_stat tag_stats(int device, std::string_view tag) {
  for (tag_stat& t : tag_stats(device)) {
    if (t.tag == tag) return t;
  }
  return tag_stat{std::string(tag), 0, 0, 0, 0};
}

namespace detail {

void write_file_replacing(const std::filesystem::path& path, std::string_view text,
                          const char* function) {
  // A temporary file beside the target, renamed over it once complete: a reader never sees a
  // partial file under the name, and a failure leaves nothing behind.
  std::filesystem::path tmp = path;
  tmp += fmt::format(".tmp.{}", static_cast<long>(getpid()));
  const auto fail = [&](const char* what, int err) {
    std::remove(tmp.c_str());
    throw invalid_argument(fmt::format("cucache: {}: cannot {} '{}': {}", function, what,
                                       path.string(), std::strerror(err)));
  };
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    const int err = errno;
    throw invalid_argument(fmt::format("cucache: {}: cannot write '{}': {}", function,
                                       path.string(), std::strerror(err)));
  }
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_err = errno;
  if (std::fclose(f) != 0 || !wrote) fail("write", wrote ? errno : write_err);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("replace", errno);
}

}  // namespace detail

void flush_trace() {
  if (registry* r = registry::if_built()) r->flush_trace();
}

}  // namespace cucache
