// The observe hub (observe_hub.hpp): device traces, live records, tags and step markers.
#include "observe/observe_hub.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <new>

#include "core/format_bytes.hpp"
#include "cucache/errors.hpp"
#include "observe/name_table.hpp"

namespace cucache::detail {

// --- tags --------------------------------------------------------------------------------------

namespace {

// The library's tags (name_table.hpp: never destroyed).
name_table& tags() {
  static auto* t = new name_table();
  return *t;
}

// The thread's tag stack; its top is the current tag, kept apart so that an allocation reads one
// thread-local word.
thread_local std::uint32_t t_current_tag = 0;
thread_local std::vector<std::uint32_t> t_tag_stack;

// The admission of the calling thread's allocation under way (observe_hub::admit): settled by
// its on_allocate (record_allocate) or on_failure (refund_admission). An allocation admits,
// allocates and reports on one thread, with no other allocation of that thread in between.
struct admission {
  std::uint32_t tag = 0;
  int device = -1;
  std::size_t bytes = 0;
};
thread_local admission t_admission;

std::uint64_t now_us() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

}  // namespace

std::uint32_t current_tag_id() noexcept {
  return t_current_tag;
}

std::string tag_name(std::uint32_t id) {
  return std::string(tags().name(id));
}

std::uint32_t tag_id(std::string_view name) {
  if (name.empty()) throw invalid_argument("cucache: push_tag: the tag is empty");
  return tags().intern(name);
}

std::uint32_t find_tag_id(std::string_view name) {
  return tags().find(name);
}

void push_tag_id(std::uint32_t id) {
  t_tag_stack.push_back(id);
  t_current_tag = id;
}

void pop_tag_id(const char* function) {
  if (t_tag_stack.empty()) {
    throw invalid_argument(
        fmt::format("cucache: {}: this thread has no current tag (a pop without a push)", function));
  }
  t_tag_stack.pop_back();
  t_current_tag = t_tag_stack.empty() ? 0 : t_tag_stack.back();
}

// --- the observer ------------------------------------------------------------------------------

const char* to_string(history_entry::action a) noexcept {
  switch (a) {
    case history_entry::action::alloc:
      return "alloc";
    case history_entry::action::free_requested:
      return "free_requested";
    case history_entry::action::free_completed:
      return "free_completed";
    case history_entry::action::segment_alloc:
      return "segment_alloc";
    case history_entry::action::segment_free:
      return "segment_free";
    case history_entry::action::segment_map:
      return "segment_map";
    case history_entry::action::segment_unmap:
      return "segment_unmap";
    case history_entry::action::oom:
      return "oom";
    case history_entry::action::snapshot:
      return "snapshot";
  }
  return "unknown";
}

namespace {

struct segment_listener {
  segment_listener_fn fn;
  void* ctx;
  const segment_listener* replaced;  // kept reachable: a reader may still hold it
};
// Never freed: a listener read by one thread while another replaces it stays valid.
std::atomic<const segment_listener*> g_segment_listener{nullptr};

void notify_segment(int device, segment_event event, std::uintptr_t base, std::size_t bytes,
                    stream_handle stream) noexcept {
  const segment_listener* l = g_segment_listener.load(std::memory_order_acquire);
  if (l != nullptr && l->fn != nullptr) [[unlikely]]
    l->fn(l->ctx, device, event, base, bytes, stream);
}

class device_observer final : public allocation_observer {
 public:
  device_observer(observe_hub& hub, int device) : hub_(hub), device_(device) {}
  /// From the first tag limit on, the allocator asks admit before every allocation.
  void enable_admission() noexcept { set_admits(true); }

  void on_allocate(const void* ptr, std::size_t requested, stream_handle stream) noexcept override {
    if (allocation_observer* t = hub_.trace()) t->on_allocate(ptr, requested, stream);
    const std::uint32_t tag = current_tag_id();
    if (tag == 0 && !hub_.always_record() && !hub_.history_on()) [[likely]]
      return;
    hub_.record_allocate(device_, ptr, requested, stream, tag);
  }
  void on_free(const void* ptr, std::size_t requested, stream_handle stream) noexcept override {
    if (allocation_observer* t = hub_.trace()) t->on_free(ptr, requested, stream);
    if (!hub_.free_needs_record() && !hub_.history_on()) [[likely]]
      return;
    hub_.record_free(device_, ptr, requested, stream);
  }
  void admit(std::size_t requested, stream_handle /*stream*/) override {
    const std::uint32_t tag = current_tag_id();
    if (tag != 0) hub_.admit(device_, tag, requested);
  }
  void on_failure(std::size_t requested, stream_handle stream) noexcept override {
    if (t_admission.bytes != 0) hub_.refund_admission(device_);
    if (allocation_observer* t = hub_.trace()) t->on_failure(requested, stream);
    if (hub_.history_on()) hub_.record_event(device_, history_entry::action::oom, 0, requested, stream);
  }
  void on_segment_alloc(std::uintptr_t base, std::size_t bytes,
                        stream_handle stream) noexcept override {
    notify_segment(device_, segment_event::alloc, base, bytes, stream);
    if (hub_.history_on())
      hub_.record_event(device_, history_entry::action::segment_alloc, base, bytes, stream);
  }
  void on_segment_map(std::uintptr_t base, std::size_t bytes,
                      stream_handle stream) noexcept override {
    notify_segment(device_, segment_event::map, base, bytes, stream);
    if (hub_.history_on())
      hub_.record_event(device_, history_entry::action::segment_map, base, bytes, stream);
  }
  void on_segment_unmap(std::uintptr_t base, std::size_t bytes,
                        stream_handle stream) noexcept override {
    notify_segment(device_, segment_event::unmap, base, bytes, stream);
    if (hub_.history_on())
      hub_.record_event(device_, history_entry::action::segment_unmap, base, bytes, stream);
  }
  void on_segment_free(std::uintptr_t base, std::size_t bytes,
                       stream_handle stream) noexcept override {
    notify_segment(device_, segment_event::free, base, bytes, stream);
    if (hub_.history_on())
      hub_.record_event(device_, history_entry::action::segment_free, base, bytes, stream);
  }

 private:
  observe_hub& hub_;
  int device_;
};

}  // namespace

void set_segment_listener(segment_listener_fn fn, void* ctx) noexcept {
  // Never freed (a reader may still call the one replaced), and each keeps the one it replaced
  // reachable, so that nothing is a leak; clearing installs one whose fn is null.
  const segment_listener* old = g_segment_listener.load(std::memory_order_acquire);
  const segment_listener* next = new (std::nothrow) segment_listener{fn, ctx, old};
  if (next == nullptr) return;
  g_segment_listener.store(next, std::memory_order_release);
}

observe_hub::observe_hub(const config& cfg, std::shared_ptr<allocation_observer> trace,
                         int devices)
    : trace_(std::move(trace)),
      history_cap_(cfg.history_entries),
      leak_steps_(cfg.leak_steps),
      backtraces_(cfg.record_backtraces && backtraces_available()),
      always_record_(cfg.leak_steps != 0 || backtraces_) {
  for (int d = 0; d < devices; ++d) devices_.push_back(std::make_unique<device_state>());
}

observe_hub::~observe_hub() = default;

std::shared_ptr<allocation_observer> observe_hub::observer_for(int device) {
  auto o = std::make_shared<device_observer>(*this, device);
  detail::lock_guard lock(observers_mu_);
  if (limits_on()) o->enable_admission();
  observers_.push_back(o);
  return o;
}

void observe_hub::push_locked(device_state& d, history_entry e) {
  if (d.ring.size() < history_cap_) {
    d.ring.push_back(std::move(e));
    return;
  }
  d.ring[d.ring_next] = std::move(e);
  d.ring_next = (d.ring_next + 1) % history_cap_;
}

void observe_hub::record_allocate(int device, const void* ptr, std::size_t size,
                                  stream_handle stream, std::uint32_t tag) noexcept {
  device_state& d = *devices_[static_cast<std::size_t>(device)];
  std::shared_ptr<const backtrace> bt;
  if (backtraces_) bt = capture_backtrace();
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  try {
    detail::lock_guard lock(d.mu);
    if (t_admission.bytes != 0 && t_admission.device == device && t_admission.tag == tag)
        [[unlikely]] {
      // Counted by admit until now: from here on as a live allocation (below).
      d.tags[tag].admitted -= t_admission.bytes;
      t_admission = {};
    }
    if (tag != 0 || always_record_) {
      d.live[addr] = live_record{size, stream, tag, step_.load(std::memory_order_relaxed), bt};
      d.live_total += size;
    }
    if (tag != 0) {
      if (d.tags.size() <= tag) d.tags.resize(tag + 1);
      tag_counter& c = d.tags[tag];
      c.current += size;
      c.peak = std::max(c.peak, c.current);
      ++c.live;
      ++c.total;
      tagged_live_.fetch_add(1, std::memory_order_relaxed);
    }
    if (history_cap_ != 0) {
      push_locked(d, history_entry{history_entry::action::alloc, addr, size, stream, now_us(), tag,
                                   std::move(bt)});
    }
  } catch (...) {
    // Host out of memory: the record is lost; the allocation the program asked for stands.
  }
}

void observe_hub::record_free(int device, const void* ptr, std::size_t size,
                              stream_handle stream) noexcept {
  device_state& d = *devices_[static_cast<std::size_t>(device)];
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  try {
    detail::lock_guard lock(d.mu);
    std::uint32_t tag = 0;
    if (auto it = d.live.find(addr); it != d.live.end()) {
      tag = it->second.tag;
      d.live_total -= it->second.size;
      if (tag != 0) {
        tag_counter& c = d.tags[tag];
        c.current -= it->second.size;
        --c.live;
        tagged_live_.fetch_sub(1, std::memory_order_relaxed);
      }
      d.live.erase(it);
    }
    if (history_cap_ != 0) {
      // cucache knows of one free: the block is reusable at once on its stream, or once other
      // streams' events complete, which no observer hears of. Both of PyTorch's events are
      // written at the free, so the viewer ends the allocation there.
      const std::uint64_t t = now_us();
      push_locked(d, history_entry{history_entry::action::free_requested, addr, size, stream, t,
                                   tag, nullptr});
      push_locked(d, history_entry{history_entry::action::free_completed, addr, size, stream, t,
                                   tag, nullptr});
    }
  } catch (...) {
  }
}

void observe_hub::record_event(int device, history_entry::action act, std::uintptr_t addr,
                               std::size_t size, stream_handle stream) noexcept {
  device_state& d = *devices_[static_cast<std::size_t>(device)];
  try {
    detail::lock_guard lock(d.mu);
    push_locked(d, history_entry{act, addr, size, stream, now_us(), 0, nullptr});
  } catch (...) {
  }
}

std::vector<history_entry> observe_hub::history(int device) const {
  const device_state& d = *devices_[static_cast<std::size_t>(device)];
  detail::lock_guard lock(d.mu);
  std::vector<history_entry> out;
  out.reserve(d.ring.size());
  for (std::size_t i = 0; i < d.ring.size(); ++i) {
    out.push_back(d.ring[(d.ring_next + i) % d.ring.size()]);
  }
  return out;
}

void observe_hub::note_snapshot() {
  if (history_cap_ == 0) return;
  for (int dev = 0; dev < static_cast<int>(devices_.size()); ++dev) {
    record_event(dev, history_entry::action::snapshot, 0, 0, nullptr);
  }
}

std::unordered_map<std::uintptr_t, live_record> observe_hub::live(int device) const {
  const device_state& d = *devices_[static_cast<std::size_t>(device)];
  detail::lock_guard lock(d.mu);
  return d.live;
}

void observe_hub::mark_step() {
  if (leak_steps_ == 0) {
    throw invalid_argument(
        "cucache: mark_step: leak hunting is off: set CUCACHE_CONF=leak_steps:K (an allocation "
        "alive for more than K steps while the live total grows is a leak candidate)");
  }
  // One marker at a time, so that every device's totals are numbered alike.
  detail::lock_guard step_lock(step_mu_);
  for (auto& d : devices_) {
    detail::lock_guard lock(d->mu);
    d->step_totals.push_back(d->live_total);
  }
  step_.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t observe_hub::leak_window(std::uint64_t steps) const {
  if (leak_steps_ == 0) {
    throw invalid_argument(
        "cucache: leak_report: leak hunting is off: set CUCACHE_CONF=leak_steps:K and call "
        "mark_step() at the end of every step");
  }
  return steps != 0 ? steps : leak_steps_;
}

std::vector<leak_candidate> observe_hub::leak_report(std::uint64_t steps) const {
  const std::uint64_t k = leak_window(steps);
  detail::lock_guard step_lock(step_mu_);
  const std::uint64_t s = step_.load(std::memory_order_relaxed);
  if (s == 0) {
    throw invalid_argument(
        "cucache: leak_report: no step was marked yet: call cucache::mark_step() "
        "(cucacheStepMarker, cucache.mark_step()) at the end of every step");
  }
  std::vector<leak_candidate> out;
  if (s <= k) return out;  // nothing can have survived more than K markers yet
  for (std::size_t dev = 0; dev < devices_.size(); ++dev) {
    const device_state& d = *devices_[dev];
    detail::lock_guard lock(d.mu);
    if (!(d.step_totals[s] > d.step_totals[s - k])) continue;  // not growing: no leak
    for (const auto& [addr, r] : d.live) {
      if (r.step >= s || s - r.step <= k) continue;
      leak_candidate c;
      c.device = static_cast<int>(dev);
      c.address = addr;
      c.size = r.size;
      c.stream = r.stream;
      c.step = r.step;
      c.steps_alive = s - r.step;
      if (r.tag != 0) c.tag = tag_name(r.tag);
      if (r.frames != nullptr) c.frames = symbolize(*r.frames);
      out.push_back(std::move(c));
    }
  }
  std::sort(out.begin(), out.end(), [](const leak_candidate& a, const leak_candidate& b) {
    if (a.size != b.size) return a.size > b.size;
    if (a.device != b.device) return a.device < b.device;
    return a.address < b.address;
  });
  return out;
}

std::vector<tag_stat> observe_hub::tag_stats(int device) const {
  const device_state& d = *devices_[static_cast<std::size_t>(device)];
  std::vector<tag_stat> out;
  {
    detail::lock_guard lock(d.mu);
    for (std::size_t id = 1; id < d.tags.size(); ++id) {
      const tag_counter& c = d.tags[id];
      if (c.total == 0 && c.limit == k_no_tag_limit && c.refusals == 0) continue;
      out.push_back(tag_stat{std::to_string(id), c.current, c.peak, c.live, c.total, c.limit,
                             c.refusals});
    }
  }
  for (tag_stat& t : out) t.tag = tag_name(static_cast<std::uint32_t>(std::stoul(t.tag)));
  std::sort(out.begin(), out.end(),
            [](const tag_stat& a, const tag_stat& b) { return a.tag < b.tag; });
  return out;
}

// --- tag limits ---------------------------------------------------------------------------------

void observe_hub::set_tag_limit(int device, std::uint32_t tag, std::size_t bytes) {
  device_state& d = *devices_[static_cast<std::size_t>(device)];
  {
    detail::lock_guard lock(d.mu);
    if (d.tags.size() <= tag) d.tags.resize(tag + 1);
    d.tags[tag].limit = bytes;
  }
  if (bytes != k_no_tag_limit && !limits_on()) {
    detail::lock_guard lock(observers_mu_);
    limits_on_.store(true, std::memory_order_release);
    for (const std::weak_ptr<allocation_observer>& w : observers_) {
      if (auto o = w.lock()) static_cast<device_observer&>(*o).enable_admission();
    }
  }
}

std::size_t observe_hub::tag_limit(int device, std::uint32_t tag) const {
  const device_state& d = *devices_[static_cast<std::size_t>(device)];
  detail::lock_guard lock(d.mu);
  return tag < d.tags.size() ? d.tags[tag].limit : k_no_tag_limit;
}

void observe_hub::admit(int device, std::uint32_t tag, std::size_t requested) {
  device_state& d = *devices_[static_cast<std::size_t>(device)];
  std::size_t limit = 0;
  std::size_t used = 0;
  std::size_t in_flight = 0;
  {
    detail::lock_guard lock(d.mu);
    if (tag >= d.tags.size()) return;  // never limited on this device
    tag_counter& c = d.tags[tag];
    if (c.limit == k_no_tag_limit) return;
    // What counts: the live allocations' requested bytes and those of allocations under way
    // (admitted, not yet settled). used may exceed a limit lowered under it.
    used = c.current + c.admitted;
    if (used <= c.limit && requested <= c.limit - used) {
      c.admitted += requested;
      t_admission = admission{tag, device, requested};
      return;
    }
    ++c.refusals;
    limit = c.limit;
    in_flight = c.admitted;
  }
  const std::string name = tag_name(tag);
  const auto both = [](std::size_t b) {
    return fmt::format("{} ({} bytes)", format_bytes(static_cast<double>(b)), b);
  };
  throw tag_limit_error(
      fmt::format("cucache: out of memory under tag '{}' on device {}: allocating {} would take "
                  "the tag past its limit of {}: it uses {}{}. Nothing was allocated; free memory "
                  "of the tag or raise its limit (set_tag_limit, cucacheSetTagLimit)",
                  name, device, both(requested), both(limit), both(used),
                  in_flight == 0 ? std::string()
                                 : fmt::format(", {} of them in allocations under way on other "
                                               "threads", in_flight)),
      name, device, limit, used, requested);
}

void observe_hub::refund_admission(int device) noexcept {
  const admission a = t_admission;
  t_admission = {};
  if (a.bytes == 0 || a.device != device) return;
  device_state& d = *devices_[static_cast<std::size_t>(device)];
  try {
    detail::lock_guard lock(d.mu);
    d.tags[a.tag].admitted -= a.bytes;
  } catch (...) {
    // std::mutex::lock failing: the bytes stay counted (a system error, not a caller's).
  }
}

}  // namespace cucache::detail
