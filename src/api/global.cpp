// The C++ global API (cucache.hpp): a thin front end over the process registry.
#include "cucache/cucache.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>
#include <system_error>

#include "allocator/tag_sleeper.hpp"
#include "api/registry.hpp"
#include "core/format_bytes.hpp"
#include "cucache/trace.hpp"
#include "observe/metrics.hpp"
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
    static_assert(detail::k_summary_width == 86, "the tags' tables below are 86 wide");
    // Rows of detail::k_summary_width: "| " + 18 + "| " + 12 + " | " + 12 + " | " + 12 + " | " +
    // 8 + " | " + 6 + " |". limit: set_tag_limit's, "-" when none.
    text += fmt::format("|{:^84}|\n", "Tags (requested bytes)");
    text += fmt::format("| {:<18}| {:>12} | {:>12} | {:>12} | {:>8} | {:>6} |\n", "tag", "current",
                        "peak", "limit", "live", "total");
    for (const tag_stat& t : tags) {
      text += fmt::format("| {:<18.18}| {:>12} | {:>12} | {:>12} | {:>8} | {:>6} |\n", t.tag,
                          t.current_bytes, t.peak_bytes,
                          t.limit_bytes == k_no_tag_limit ? std::string("-")
                                                          : std::to_string(t.limit_bytes),
                          t.allocations, t.total_allocations);
    }
    text += fmt::format("|{:=^84}|\n", "");
  }
  const std::vector<sleep_stat> asleep = sleeping(device);
  if (!asleep.empty()) {
    // Sleeping tags (sleep and wake): device bytes released, host bytes holding their contents.
    // "| " + 33 + "| " + 22 + " | " + 22 + " |".
    text += fmt::format("|{:^84}|\n", "Sleeping tags");
    text += fmt::format("| {:<33}| {:>22} | {:>22} |\n", "tag", "device released", "host copy");
    for (const sleep_stat& t : asleep) {
      text += fmt::format("| {:<33.33}| {:>22} | {:>22} |\n", t.tag, t.bytes, t.host_bytes);
    }
    text += fmt::format("|{:=^84}|\n", "");
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

namespace {
// Sleepable tags (make_sleepable): process-wide, by tag id; each thread's sleep domain follows its
// current tag (set on push and pop). Guarded by g_sleepable_mu; read on push and pop only.
detail::mutex g_sleepable_mu;
std::vector<bool> g_sleepable GUARDED_BY(g_sleepable_mu);  // by tag id

bool sleepable_id(std::uint32_t id) {
  detail::lock_guard lock(g_sleepable_mu);
  return id < g_sleepable.size() && g_sleepable[id];
}

/// The calling thread's sleep domain after its tag stack changed: its current tag's id when that
/// tag is sleepable.
void follow_current_tag() {
  const std::uint32_t id = detail::current_tag_id();
  device_allocator::set_thread_sleep_domain(id != 0 && sleepable_id(id) ? id : 0);
}

/// The device bytes domain `id` releases while asleep (0 when awake): a sleep or wake row's Size.
std::size_t sleeping_bytes_of(const device_allocator& a, std::uint32_t id) {
  for (const device_allocator::sleep_state& st : a.sleeping()) {
    if (st.domain == id) return st.bytes;
  }
  return 0;
}

/// The id of a tag that sleep or wake may act on: known and sleepable, else invalid_argument.
std::uint32_t sleepable_tag(std::string_view tag, const char* function) {
  const std::uint32_t id = tag.empty() ? 0 : detail::find_tag_id(tag);
  if (id == 0) {
    throw invalid_argument(fmt::format("cucache: {}: unknown tag '{}' (no tag of that name was "
                                       "made sleepable or pushed); nothing changed",
                                       function, tag));
  }
  if (!sleepable_id(id)) {
    throw invalid_argument(fmt::format(
        "cucache: {}: tag '{}' is not sleepable: call make_sleepable (cucacheMakeTagSleepable, "
        "cucache.make_sleepable) before allocating under it; nothing changed",
        function, tag));
  }
  return id;
}
}  // namespace

void push_tag(std::string_view tag) {
  const std::uint32_t id = detail::tag_id(tag);
  registry::instance().activate_observers();  // allocators pay for observing only from now on
  detail::push_tag_id(id);
  follow_current_tag();
}


void pop_tag() {
  detail::pop_tag_id("pop_tag");
  follow_current_tag();
}

void make_sleepable(std::string_view tag) {
  if (tag.empty()) throw invalid_argument("cucache: make_sleepable: the tag is empty");
  const std::uint32_t id = detail::tag_id(tag);
  if (id > detail::k_max_sleep_domain) {
    throw invalid_argument(fmt::format("cucache: make_sleepable: tag '{}' is tag number {}; at most "
                                       "{} tags can be sleepable",
                                       tag, id, detail::k_max_sleep_domain));
  }
  registry::instance().activate_observers();  // tag statistics, as push_tag
  {
    detail::lock_guard lock(g_sleepable_mu);
    if (g_sleepable.size() <= id) g_sleepable.resize(id + 1, false);
    g_sleepable[id] = true;
  }
  follow_current_tag();
}

bool is_sleepable(std::string_view tag) {
  const std::uint32_t id = tag.empty() ? 0 : detail::find_tag_id(tag);
  return id != 0 && sleepable_id(id);
}

void sleep(int device, std::string_view tag, bool keep_contents) {
  const tag_sleep_request one{tag, keep_contents};
  sleep(device, std::span<const tag_sleep_request>(&one, 1));
}

void sleep(int device, std::span<const tag_sleep_request> tags) {
  if (tags.empty()) throw invalid_argument("cucache: sleep: the list of tags is empty");
  std::vector<device_allocator::sleep_request> requests;
  requests.reserve(tags.size());
  for (const tag_sleep_request& t : tags) {
    const std::uint32_t id = sleepable_tag(t.tag, "sleep");
    // Every live block of the tag must be in its pages (its graph pools' included: a pool created
    // under the tag sleeps with it): blocks allocated under it before it was made sleepable, or
    // in a graph pool created under another tag, share memory with others and cannot sleep. The check
    // runs under every pool lock, where no free is half done (the hub hears of a free under its
    // pool's lock) but an allocation may be: the hub hears of it only after it returned. So the
    // hub's count of the tag's blocks in its pages never exceeds the pools' bytes, and only a
    // count above them proves a block outside (an allocation under way on another thread is
    // never taken for one).
    const std::string_view tag = t.tag;
    requests.push_back({id, t.keep_contents, tag, [device, tag](std::size_t placed) {
                          const std::uint64_t tagged = tag_stats(device, tag).current_bytes;
                          if (tagged > placed) {
                            throw invalid_argument(fmt::format(
                                "cucache: sleep: tag '{}' on device {} has {} live bytes, of "
                                "which {} lie in its own pages; the rest were allocated before "
                                "make_sleepable, or inside a CUDA graph capture whose pool was "
                                "created under another tag (or none), and cannot sleep (free "
                                "them first); nothing changed",
                                tag, device, tagged, placed));
                          }
                        }});
  }
  device_allocator& a = get(device);
  a.sleep(requests);
  if (trace_recorder* rec = registry::instance().recorder()) {
    for (const device_allocator::sleep_request& r : requests) {
      try {
        rec->record_sleep(r.label, r.keep_contents, sleeping_bytes_of(a, r.domain));
      } catch (...) {
        rec->note_lost_row();  // as the allocation rows: the sleep the program asked for stands
      }
    }
  }
}

std::size_t prepare_sleep(int device, std::string_view tag, std::size_t bytes) {
  const std::uint32_t id = sleepable_tag(tag, "prepare_sleep");
  return get(device).prepare_sleep(id, bytes, tag);
}

std::size_t sleep_buffer_bytes(int device, std::string_view tag) {
  device_allocator* a = registry::instance().find(device);
  const std::uint32_t id = tag.empty() ? 0 : detail::find_tag_id(tag);
  return a == nullptr || id == 0 ? 0 : a->sleep_buffer_bytes(id);
}

void wake(int device, std::string_view tag) { wake(device, std::span<const std::string_view>(&tag, 1)); }

void wake(int device, std::span<const std::string_view> tags) {
  if (tags.empty()) throw invalid_argument("cucache: wake: the list of tags is empty");
  std::vector<device_allocator::wake_request> requests;
  requests.reserve(tags.size());
  for (const std::string_view tag : tags) requests.push_back({sleepable_tag(tag, "wake"), tag});
  device_allocator& a = get(device);
  std::vector<std::size_t> bytes;
  bytes.reserve(requests.size());
  for (const auto& r : requests) bytes.push_back(sleeping_bytes_of(a, r.domain));
  a.wake(requests);
  if (trace_recorder* rec = registry::instance().recorder()) {
    for (std::size_t i = 0; i < requests.size(); ++i) {
      try {
        rec->record_wake(requests[i].label, bytes[i]);
      } catch (...) {
        rec->note_lost_row();
      }
    }
  }
}

double last_wake_copy_seconds(int device, std::string_view tag) {
  device_allocator* a = registry::instance().find(device);
  const std::uint32_t id = tag.empty() ? 0 : detail::find_tag_id(tag);
  return a == nullptr || id == 0 || id > detail::k_max_sleep_domain
             ? 0.0
             : a->last_wake_copy_seconds(id);
}

std::vector<sleep_stat> sleeping(int device) {
  registry& r = registry::instance();
  if (device < 0 || device >= r.device_count()) {
    throw cuda_error("cucache::sleeping", static_cast<int>(cudaErrorInvalidDevice),
                     fmt::format("invalid device ordinal {} ({} device{})", device,
                                 r.device_count(), r.device_count() == 1 ? "" : "s"));
  }
  device_allocator* a = r.find(device);
  if (a == nullptr) return {};
  std::vector<sleep_stat> out;
  for (const device_allocator::sleep_state& st : a->sleeping()) {
    out.push_back({detail::tag_name(st.domain), st.bytes, st.host_bytes, st.copy_seconds});
  }
  std::sort(out.begin(), out.end(),
            [](const sleep_stat& x, const sleep_stat& y) { return x.tag < y.tag; });
  return out;
}

std::string current_tag() {
  return detail::tag_name(detail::current_tag_id());
}

std::vector<tag_stat> tag_stats(int device) {
  registry& r = registry::instance();
  if (device < 0 || device >= r.device_count()) return {};
  return r.hub().tag_stats(device);
}

tag_stat tag_stats(int device, std::string_view tag) {
  for (tag_stat& t : tag_stats(device)) {
    if (t.tag == tag) return t;
  }
  tag_stat none;
  none.tag = std::string(tag);
  return none;
}

namespace {

/// `device` when it exists, else cuda_error cudaErrorInvalidDevice naming `function`.
int existing_device(registry& r, int device, const char* function) {
  if (device < 0 || device >= r.device_count()) {
    throw cuda_error(fmt::format("cucache::{}", function), static_cast<int>(cudaErrorInvalidDevice),
                     fmt::format("invalid device ordinal {} ({} device{})", device,
                                 r.device_count(), r.device_count() == 1 ? "" : "s"));
  }
  return device;
}

}  // namespace

void set_tag_limit(int device, std::string_view tag, std::size_t bytes) {
  if (tag.empty()) throw invalid_argument("cucache: set_tag_limit: the tag is empty");
  registry& r = registry::instance();
  existing_device(r, device, "set_tag_limit");
  const std::uint32_t id = detail::tag_id(tag);
  r.activate_observers();  // the limit is checked by the hub's observer
  r.hub().set_tag_limit(device, id, bytes);
}

std::size_t tag_limit(int device, std::string_view tag) {
  if (tag.empty()) throw invalid_argument("cucache: tag_limit: the tag is empty");
  registry& r = registry::instance();
  existing_device(r, device, "tag_limit");
  const std::uint32_t id = detail::find_tag_id(tag);
  return id == 0 ? k_no_tag_limit : r.hub().tag_limit(device, id);
}

std::string metrics() {
  registry& r = registry::instance();
  std::vector<detail::device_metrics> devices;
  for (int d = 0; d < r.device_count(); ++d) {
    const device_allocator* a = r.find(d);
    if (a == nullptr) continue;  // never used: no allocator is created for a scrape
    devices.push_back(detail::device_metrics{d, a->stats(), r.hub().tag_stats(d), sleeping(d)});
  }
  std::string out;
  out.reserve(32768);
  detail::append_metrics(out, devices);
  return out;
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
