// The memory timeline page (see timeline.hpp): the replay that gathers the data, the bucketing
// that keeps large traces small, and the page assembled from the embedded resources.
#include "timeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <system_error>
#include <unordered_map>

#include "cucache/backend_factory.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/forwarding_backend.hpp"
#include "cucache/sim_backend.hpp"
#include "peers.hpp"
#include "replay_setup.hpp"
#include "timeline_resources.hpp"  // generated: k_timeline_html, k_timeline_css, k_timeline_js

namespace cucache::replay {
namespace {

// Marks: the device calls and allocator events drawn under the chart, in this order.
enum mark_kind : std::size_t {
  mk_cuda_malloc,
  mk_cuda_free,
  mk_malloc_refused,
  mk_va_reserve,
  mk_va_free,
  mk_vm_create,
  mk_vm_create_refused,
  mk_vm_map,
  mk_vm_unmap,
  mk_vm_release,
  mk_synchronize,
  mk_retry,
  mk_reclaim,
  mk_oom,
  mk_sleep,  // a trace's sleep row (cucache's extension): the tag's pages released
  mk_wake,   // its wake: the pages mapped again at the same addresses
  mk_count
};
constexpr const char* k_mark_names[mk_count] = {
    "cudaMalloc",    "cudaFree",   "cudaMalloc refused", "VM reserve", "VM free",
    "VM create",     "VM create refused", "VM map", "VM unmap",   "VM release",
    "synchronize",   "retry (cache flushed)", "reclaim (idle memory returned)", "out of memory",
    "sleep",         "wake"};

constexpr std::size_t k_pools = 2;  // small, large
constexpr std::size_t kind_of(std::size_t requested) noexcept {
  // A request of at most 1 MiB rounds to at most 1 MiB (every rounding stops at a power of two
  // not below it), and rounded requests up to 1 MiB are the small pool's (size_policy::pool_for).
  return requested <= (std::size_t{1} << 20) ? 0 : 1;
}

/// Current reserved bytes per stream and pool as the device calls change them.
struct reservations {
  std::vector<std::array<std::int64_t, k_pools>> by_stream;
  std::array<std::int64_t, k_pools> by_pool{};
  std::int64_t total = 0;
  void add(std::size_t stream, std::size_t kind, std::int64_t delta) {
    by_stream[stream][kind] += delta;
    by_pool[kind] += delta;
    total += delta;
  }
};

/// Forwards every call to the real backend (forwarding_backend) and tells `watcher` of each device
/// call: which one, and how it changes reserved memory. Only a timeline replay installs it.
class recording_backend final : public forwarding_backend {
 public:
  struct watcher {
    virtual void device_call(mark_kind k) = 0;
    virtual void reserved_changed() = 0;
  };
  recording_backend(std::shared_ptr<device_backend> inner, std::size_t streams)
      : forwarding_backend(std::move(inner)) {
    res.by_stream.assign(streams, {});
  }
  reservations res;
  watcher* w = nullptr;
  // The event being replayed: device calls that create memory belong to its stream and pool.
  std::size_t cur_stream = 0;
  std::size_t cur_kind = 0;

  [[nodiscard]] void* segment_malloc(std::size_t bytes) override {
    void* p = forwarding_backend::segment_malloc(bytes);
    if (p == nullptr) {
      w->device_call(mk_malloc_refused);
      return p;
    }
    owners_[reinterpret_cast<std::uintptr_t>(p)] = {bytes, cur_stream, cur_kind};
    res.add(cur_stream, cur_kind, static_cast<std::int64_t>(bytes));
    w->device_call(mk_cuda_malloc);
    w->reserved_changed();
    return p;
  }
  void segment_free(void* ptr) override {
    forwarding_backend::segment_free(ptr);
    const auto it = owners_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it != owners_.end()) {
      res.add(it->second.stream, it->second.kind, -static_cast<std::int64_t>(it->second.bytes));
      owners_.erase(it);
    }
    w->device_call(mk_cuda_free);
    w->reserved_changed();
  }
  [[nodiscard]] void* va_reserve(std::size_t bytes) override {
    void* va = forwarding_backend::va_reserve(bytes);
    if (va != nullptr) {
      ranges_[reinterpret_cast<std::uintptr_t>(va)] = {bytes, cur_stream, cur_kind};
    }
    w->device_call(mk_va_reserve);
    return va;
  }
  void va_free(void* base, std::size_t bytes) override {
    forwarding_backend::va_free(base, bytes);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(base));
    w->device_call(mk_va_free);
  }
  [[nodiscard]] std::optional<phys_handle> phys_create(std::size_t bytes) override {
    auto h = forwarding_backend::phys_create(bytes);
    w->device_call(h ? mk_vm_create : mk_vm_create_refused);
    return h;
  }
  void phys_release(phys_handle handle) override {
    forwarding_backend::phys_release(handle);
    w->device_call(mk_vm_release);
  }
  void map(void* va, std::size_t bytes, phys_handle handle) override {
    forwarding_backend::map(va, bytes, handle);
    const owner o = range_of(va);
    res.add(o.stream, o.kind, static_cast<std::int64_t>(bytes));
    w->device_call(mk_vm_map);
    w->reserved_changed();
  }
  void unmap(void* va, std::size_t bytes) override {
    forwarding_backend::unmap(va, bytes);
    const owner o = range_of(va);
    res.add(o.stream, o.kind, -static_cast<std::int64_t>(bytes));
    w->device_call(mk_vm_unmap);
    w->reserved_changed();
  }
  void device_synchronize() override {
    forwarding_backend::device_synchronize();
    w->device_call(mk_synchronize);
  }

 private:
  struct owner {
    std::size_t bytes = 0;
    std::size_t stream = 0;
    std::size_t kind = 0;
  };
  owner range_of(const void* va) const {
    const auto a = reinterpret_cast<std::uintptr_t>(va);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) {
      throw error(fmt::format("timeline: a mapping at {:#x} outside every reserved range", a));
    }
    --it;
    if (a >= it->first + it->second.bytes) {
      throw error(fmt::format("timeline: a mapping at {:#x} outside every reserved range", a));
    }
    return it->second;
  }
  std::unordered_map<std::uintptr_t, owner> owners_;  // segments, by base
  std::map<std::uintptr_t, owner> ranges_;            // expandable virtual ranges, by base
};

/// Min/max envelopes of every series over runs of consecutive events ("buckets"): bucket b holds
/// events [b*n/B, (b+1)*n/B). Every value a series takes -- after each event, and in between
/// when a device call changes reserved memory -- lands in its bucket's envelope.
struct series_set {
  std::size_t buckets = 0;
  std::size_t events = 0;
  std::vector<std::vector<std::int64_t>> lo, hi;
  void init(std::size_t n_series, std::size_t n_events, std::size_t max_buckets) {
    events = n_events;
    buckets = std::max<std::size_t>(1, std::min(n_events, max_buckets));
    lo.assign(n_series, std::vector<std::int64_t>(buckets, std::numeric_limits<std::int64_t>::max()));
    hi.assign(n_series, std::vector<std::int64_t>(buckets, std::numeric_limits<std::int64_t>::min()));
  }
  // Events are at most 2^32 (prepare) and buckets 2^15 or so: the products fit 64 bits.
  [[nodiscard]] std::size_t bucket_of(std::size_t event) const noexcept {
    return events == 0 ? 0 : static_cast<std::size_t>((std::uint64_t{event} * buckets) / events);
  }
  void put(std::size_t series, std::size_t bucket, std::int64_t v) {
    lo[series][bucket] = std::min(lo[series][bucket], v);
    hi[series][bucket] = std::max(hi[series][bucket], v);
  }
};

// Series layout: group g (0 all, 1 small, 2 large, 3 + k stream k) x metric m (0 requested,
// 1 allocated, 2 reserved): index 3 * g + m; then one more, "all" / "sleeping": the device bytes
// sleeping tags have given back (the allocator's sleeping_bytes).
constexpr std::size_t k_metrics = 3;

struct live_block {
  std::size_t requested = 0;
  std::size_t rounded = 0;
  std::uint32_t stream = 0;
};

class timeline_replay final : public recording_backend::watcher {
 public:
  timeline_replay(const prepared_trace& t, const std::vector<trace_event>* events,
                  const options& opts, const timeline_options& topts)
      : t_(t), events_(events), opts_(opts), topts_(topts) {}

  nlohmann::json run();

  void device_call(mark_kind k) override { count_mark(k); }
  void reserved_changed() override {
    // Between events: reserved memory moves inside an allocation (the out-of-memory ladder can
    // create and release memory within one call), and its peak may be reached there.
    put_reserved();
  }

 private:
  void count_mark(mark_kind k) {
    if (!recording_) return;
    auto& m = marks_[k];
    const std::size_t b = series_.bucket_of(cur_event_);
    if (!m.empty() && m.back().first == b) {
      ++m.back().second;
    } else {
      m.emplace_back(b, 1);
    }
    ++mark_totals_[k];
    ++calls_in_event_;
  }
  void put_reserved() {
    if (!recording_) return;
    const std::size_t b = series_.bucket_of(cur_event_);
    const reservations& r = rec_->res;
    series_.put(2, b, r.total);
    for (std::size_t k = 0; k < k_pools; ++k) series_.put(3 * (1 + k) + 2, b, r.by_pool[k]);
    for (std::size_t s = 0; s < r.by_stream.size(); ++s) {
      series_.put(3 * (3 + s) + 2, b, r.by_stream[s][0] + r.by_stream[s][1]);
    }
    if (r.total > peak_reserved_) {
      peak_reserved_ = r.total;
      peak_event_ = cur_event_;
    }
  }
  void put_all() {
    const std::size_t b = series_.bucket_of(cur_event_);
    series_.put(sleeping_series_, b, sleeping_);
    series_.put(0, b, req_total_);
    series_.put(1, b, alloc_total_);
    for (std::size_t k = 0; k < k_pools; ++k) {
      series_.put(3 * (1 + k) + 0, b, req_pool_[k]);
      series_.put(3 * (1 + k) + 1, b, alloc_pool_[k]);
    }
    for (std::size_t s = 0; s < req_stream_.size(); ++s) {
      series_.put(3 * (3 + s) + 0, b, req_stream_[s]);
      series_.put(3 * (3 + s) + 1, b, alloc_stream_[s]);
    }
    put_reserved();
    peak_alloc_ = std::max(peak_alloc_, alloc_total_);
    peak_req_ = std::max(peak_req_, req_total_);
  }
  /// Replays events [0, stop) through a fresh allocator; `record`: fill the series and marks.
  /// Returns the allocator's stats at the end, and leaves the live blocks in live_.
  device_stats pass(std::size_t stop, bool record, nlohmann::json* snapshot);

  const prepared_trace& t_;
  const std::vector<trace_event>* events_;
  const options& opts_;
  const timeline_options& topts_;
  recording_backend* rec_ = nullptr;
  bool recording_ = false;
  std::size_t cur_event_ = 0;
  std::size_t calls_in_event_ = 0;
  series_set series_;
  std::array<std::vector<std::pair<std::size_t, std::uint64_t>>, mk_count> marks_;
  std::array<std::uint64_t, mk_count> mark_totals_{};
  std::int64_t req_total_ = 0, alloc_total_ = 0;
  std::int64_t sleeping_ = 0, peak_sleeping_ = 0;  // the allocator's sleeping_bytes
  std::size_t sleeping_series_ = 0;
  std::uint64_t sleeps_ = 0, wakes_ = 0;
  std::array<std::int64_t, k_pools> req_pool_{}, alloc_pool_{};
  std::vector<std::int64_t> req_stream_, alloc_stream_;
  std::int64_t peak_reserved_ = -1, peak_alloc_ = 0, peak_req_ = 0;
  std::size_t peak_event_ = 0;
  std::vector<live_block> live_;  // by slot (event index of the allocation)
  std::vector<void*> slots_;
};

device_stats timeline_replay::pass(std::size_t stop, bool record, nlohmann::json* snapshot) {
  const replay_streams streams(t_, opts_.backend);
  const std::span<const stream_handle> handles = streams.handles();
  auto rec = std::make_shared<recording_backend>(backend_for(opts_), t_.stream_ids.size());
  rec->w = this;
  rec_ = rec.get();
  recording_ = record;
  device_allocator a(rec, effective_config(opts_));
  // Allocations under a tag the trace sleeps go to its sleep domain (prepare); the thread's
  // domain is set per allocation and reset when the pass ends.
  struct domain_reset {
    ~domain_reset() { device_allocator::set_thread_sleep_domain(0); }
  } reset_domain;
  sleeping_ = 0;
  if (record) sleeps_ = wakes_ = 0;
  slots_.assign(t_.ops.size(), nullptr);
  live_.assign(t_.ops.size(), {});
  req_total_ = alloc_total_ = 0;
  req_pool_ = alloc_pool_ = {};
  req_stream_.assign(t_.stream_ids.size(), 0);
  alloc_stream_.assign(t_.stream_ids.size(), 0);
  device_stats before{};
  for (std::size_t i = 0; i < stop; ++i) {
    const replay_op& op = t_.ops[i];
    cur_event_ = i;
    calls_in_event_ = 0;
    switch (op.kind) {
      case op_kind::allocate: {
        if (op.domain != 0 && a.is_asleep(op.domain)) break;  // its wake was refused
        device_allocator::set_thread_sleep_domain(op.domain);
        rec->cur_stream = op.stream;
        rec->cur_kind = kind_of(op.size);
        void* p = nullptr;
        try {
          p = a.allocate(op.size, handles[op.stream]);
        } catch (const out_of_memory&) {
          count_mark(mk_oom);
        }
        if (p != nullptr) {
          slots_[op.slot] = p;
          live_block& lb = live_[op.slot];
          lb.requested = op.size;
          lb.rounded = a.allocation_size(p);
          lb.stream = op.stream;
          const std::size_t k = kind_of(op.size);
          const auto req = static_cast<std::int64_t>(op.size);
          const auto rnd = static_cast<std::int64_t>(lb.rounded);
          req_total_ += req;
          alloc_total_ += rnd;
          req_pool_[k] += req;
          alloc_pool_[k] += rnd;
          req_stream_[op.stream] += req;
          alloc_stream_[op.stream] += rnd;
        }
        break;
      }
      case op_kind::free:
      case op_kind::free_on_other_stream:
        if (void* p = slots_[op.slot]; p != nullptr) {
          if (op.domain != 0 && a.is_asleep(op.domain)) break;  // its wake was refused
          rec->cur_stream = op.stream;
          const live_block& lb = live_[op.slot];
          rec->cur_kind = kind_of(lb.requested);
          if (op.kind == op_kind::free_on_other_stream) {
            a.deallocate(p, handles[op.stream]);
          } else {
            a.deallocate(p);
          }
          slots_[op.slot] = nullptr;
          const std::size_t k = kind_of(lb.requested);
          const auto req = static_cast<std::int64_t>(lb.requested);
          const auto rnd = static_cast<std::int64_t>(lb.rounded);
          req_total_ -= req;
          alloc_total_ -= rnd;
          req_pool_[k] -= req;
          alloc_pool_[k] -= rnd;
          req_stream_[lb.stream] -= req;
          alloc_stream_[lb.stream] -= rnd;
        }
        break;
      case op_kind::sleep:
      case op_kind::sleep_keep:
        if (a.is_asleep(op.domain)) break;  // its last wake was refused
        a.sleep(op.domain, op.kind == op_kind::sleep_keep);
        count_mark(mk_sleep);
        if (record) ++sleeps_;
        sleeping_ = static_cast<std::int64_t>(a.stats().sleeping_bytes);
        peak_sleeping_ = std::max(peak_sleeping_, sleeping_);
        break;
      case op_kind::wake:
        try {
          a.wake(op.domain);
          count_mark(mk_wake);
          if (record) ++wakes_;
        } catch (const out_of_memory&) {
          count_mark(mk_oom);  // no room: the tag stays asleep, its blocks untouched
        }
        sleeping_ = static_cast<std::int64_t>(a.stats().sleeping_bytes);
        break;
      case op_kind::none:
        break;
    }
    if (record) {
      // Retries and reclaims are the allocator's own steps, visible only in its counters; look
      // at them only after events that made device calls (the ladder makes some).
      if (calls_in_event_ != 0) {
        const device_stats s = a.stats();
        for (std::uint64_t n = before.alloc_retry_count; n < s.alloc_retry_count; ++n) count_mark(mk_retry);
        for (std::uint64_t n = before.vm_reclaim_count; n < s.vm_reclaim_count; ++n) count_mark(mk_reclaim);
        before = s;
      }
      put_all();
    }
  }
  if (snapshot != nullptr) {
    *snapshot = nlohmann::json::parse(a.snapshot_json());
    // The page's totals at the peak: the snapshot carries them in its field-table "stats".
    const device_stats st = a.stats();
    (*snapshot)["reserved_bytes"] = st.reserved_bytes[0].current;
    (*snapshot)["allocated_bytes"] = st.allocated_bytes[0].current;
  }
  device_stats s = a.stats();
  if (record && rec->res.total != s.reserved_bytes[0].current) {
    throw error(fmt::format("timeline: {}: reserved bytes counted from device calls ({}) differ "
                            "from the allocator's ({})",
                            t_.name, rec->res.total, s.reserved_bytes[0].current));
  }
  for (std::size_t k = 0; record && k < k_pools; ++k) {
    if (rec->res.by_pool[k] != s.reserved_bytes[1 + k].current ||
        alloc_pool_[k] != s.allocated_bytes[1 + k].current) {
      throw error(fmt::format("timeline: {}: the {} pool's bytes counted here (reserved {}, "
                              "allocated {}) differ from the allocator's ({}, {})",
                              t_.name, k == 0 ? "small" : "large", rec->res.by_pool[k],
                              alloc_pool_[k], s.reserved_bytes[1 + k].current,
                              s.allocated_bytes[1 + k].current));
    }
  }
  recording_ = false;
  rec_ = nullptr;
  // The allocator (and its segments) go before `rec` does; nothing is recorded meanwhile.
  return s;
}

nlohmann::json timeline_replay::run() {
  using nlohmann::json;
  const std::size_t n = t_.ops.size();
  const std::size_t streams = t_.stream_ids.size();
  sleeping_series_ = k_metrics * (3 + streams);
  series_.init(sleeping_series_ + 1, n, topts_.max_buckets);

  const device_stats end = pass(n, /*record=*/true, nullptr);
  if (peak_reserved_ < 0) peak_reserved_ = 0;
  if (peak_reserved_ != end.reserved_bytes[0].peak) {
    throw error(fmt::format("timeline: {}: the reserved peak seen here ({}) differs from the "
                            "allocator's ({})",
                            t_.name, peak_reserved_, end.reserved_bytes[0].peak));
  }

  // The state at the peak: a second replay up to and including the peak's event.
  json snapshot;
  if (n != 0) {
    static_cast<void>(pass(peak_event_ + 1, /*record=*/false, &snapshot));
  } else {
    snapshot = json::object({{"segments", json::array()}});
  }
  std::vector<std::size_t> alive;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i] != nullptr) alive.push_back(i);
  }
  std::sort(alive.begin(), alive.end(), [&](std::size_t x, std::size_t y) {
    if (live_[x].rounded != live_[y].rounded) return live_[x].rounded > live_[y].rounded;
    if (live_[x].requested != live_[y].requested) return live_[x].requested > live_[y].requested;
    return x < y;
  });
  json allocations = json::array();
  std::size_t alive_requested = 0, alive_rounded = 0;
  for (const std::size_t i : alive) {
    alive_requested += live_[i].requested;
    alive_rounded += live_[i].rounded;
  }
  for (std::size_t j = 0; j < alive.size() && j < topts_.max_peak_allocations; ++j) {
    const std::size_t i = alive[j];
    json a = {{"event", i},
              {"size", live_[i].requested},
              {"rounded", live_[i].rounded},
              {"stream", live_[i].stream},
              {"address", reinterpret_cast<std::uintptr_t>(slots_[i])}};
    if (events_ != nullptr && i < events_->size()) {
      const trace_event& ev = (*events_)[i];
      a["line"] = ev.line;
      a["thread"] = ev.thread;
      a["time_us"] = ev.time_us;
    }
    if (t_.snapshot != nullptr && i < t_.snapshot->event_stacks.size()) {
      // A PyTorch snapshot's call stack of the allocation, innermost first (at most 16 frames).
      json frames = json::array();
      for (const snapshot_frame& f : t_.snapshot->stacks[t_.snapshot->event_stacks[i]]) {
        if (frames.size() == 16) break;
        frames.push_back(fmt::format("{} at {}:{}", f.name, f.filename, f.line));
      }
      if (!frames.empty()) a["frames"] = std::move(frames);
    }
    allocations.push_back(std::move(a));
  }
  slots_.clear();
  live_.clear();

  json series = json::array();
  const char* metric_names[k_metrics] = {"requested", "allocated", "reserved"};
  for (std::size_t g = 0; g < 3 + streams; ++g) {
    std::string group = g == 0 ? "all" : g == 1 ? "small pool" : g == 2 ? "large pool" : "";
    if (g >= 3) group = fmt::format("stream {:#x}", t_.stream_ids[g - 3]);
    for (std::size_t m = 0; m < k_metrics; ++m) {
      const std::size_t s = k_metrics * g + m;
      // A bucket that saw no value (impossible: every event puts every series) stays unset.
      series.push_back({{"group", group},
                        {"metric", metric_names[m]},
                        {"min", series_.lo[s]},
                        {"max", series_.hi[s]}});
    }
  }
  series.push_back({{"group", "all"},
                    {"metric", "sleeping"},
                    {"min", series_.lo[sleeping_series_]},
                    {"max", series_.hi[sleeping_series_]}});
  json marks = json::array();
  for (std::size_t k = 0; k < mk_count; ++k) {
    if (mark_totals_[k] == 0) continue;
    json buckets = json::array(), counts = json::array();
    for (const auto& [b, c] : marks_[k]) {
      buckets.push_back(b);
      counts.push_back(c);
    }
    marks.push_back({{"name", k_mark_names[k]},
                     {"total", mark_totals_[k]},
                     {"buckets", std::move(buckets)},
                     {"counts", std::move(counts)}});
  }
  json stream_ids = json::array();
  for (const std::uintptr_t id : t_.stream_ids) stream_ids.push_back(fmt::format("{:#x}", id));
  json times = json::array();
  if (events_ != nullptr && !events_->empty()) {
    for (std::size_t b = 0; b < series_.buckets; ++b) {
      const std::size_t first = (std::uint64_t{b} * n + series_.buckets - 1) / series_.buckets;
      times.push_back(first < events_->size() ? (*events_)[first].time_us : 0);
    }
  }
  return json{
      {"format", "cucache-timeline-1"},
      {"trace", t_.name},
      {"backend", to_string(opts_.backend)},
      {"config", to_string(opts_.cfg)},
      {"expandable", opts_.cfg.expandable_segments},
      {"events", n},
      {"snapshot", t_.snapshot != nullptr},
      {"buckets", series_.buckets},
      {"streams", std::move(stream_ids)},
      {"series", std::move(series)},
      {"bucket_time_us", std::move(times)},
      {"marks", std::move(marks)},
      {"peak",
       {{"reserved_bytes", peak_reserved_},
        {"event", peak_event_},
        {"bucket", series_.bucket_of(peak_event_)},
        {"line", events_ != nullptr && peak_event_ < events_->size() ? (*events_)[peak_event_].line
                                                                     : std::size_t{0}},
        {"allocated_bytes", peak_alloc_},
        {"requested_bytes", peak_req_},
        {"alive_count", alive.size()},
        {"alive_requested_bytes", alive_requested},
        {"alive_rounded_bytes", alive_rounded},
        {"allocations", std::move(allocations)},
        {"snapshot", std::move(snapshot)}}},
      {"totals",
       {{"device_alloc_calls", end.device_alloc_count},
        {"device_free_calls", end.device_free_count},
        {"oom_count", end.oom_count},
        // In expandable mode the device allocations and frees are cuMemCreate / cuMemRelease.
        {"vm_create_calls", opts_.cfg.expandable_segments ? end.device_alloc_count : 0},
        {"vm_map_calls", end.vm_map_count},
        {"vm_unmap_calls", end.vm_unmap_count},
        {"vm_release_calls", opts_.cfg.expandable_segments ? end.device_free_count : 0},
        {"sleeps", sleeps_},
        {"wakes", wakes_},
        {"peak_sleeping_bytes", peak_sleeping_}}},
  };
}

/// Replaces the first `marker` in `page` by `text`.
void substitute(std::string& page, std::string_view marker, std::string_view text) {
  const auto at = page.find(marker);
  if (at == std::string::npos) {
    throw error(fmt::format("timeline: the page template lacks {}", marker));
  }
  page.replace(at, marker.size(), text);
}

}  // namespace

nlohmann::json timeline_data(const prepared_trace& trace, const std::vector<trace_event>* events,
                             const options& opts, const timeline_options& topts) {
  if (topts.max_buckets == 0) throw invalid_argument("timeline: max_buckets must be positive");
  check_sleep_replayable(trace, opts.cfg.expandable_segments, /*peers=*/false);
  timeline_replay r(trace, events, opts, topts);
  return r.run();
}

std::string timeline_html(const nlohmann::json& data) {
  std::string json = data.dump();
  // Inside <script>, "</" could close the element; JSON allows "<\/" for it.
  for (std::size_t at = 0; (at = json.find("</", at)) != std::string::npos; at += 3) {
    json.replace(at, 2, "<\\/");
  }
  std::string page(k_timeline_html);
  std::string title = data.value("trace", std::string("trace"));
  for (char& c : title) {
    if (c == '<' || c == '>' || c == '&' || c == '"') c = '_';
  }
  substitute(page, "@CUCACHE_TITLE@", title);
  substitute(page, "/*@CUCACHE_CSS@*/", k_timeline_css);
  substitute(page, "/*@CUCACHE_JS@*/", k_timeline_js);
  substitute(page, "@CUCACHE_DATA@", json);
  return page;
}

void write_file_atomically(const std::filesystem::path& out, const std::string& text) {
  namespace fs = std::filesystem;
  std::random_device rd;
  const fs::path tmp =
      out.parent_path() / fmt::format(".{}.tmp{:08x}", out.filename().string(), rd());
  auto fail = [&](const std::string& why) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw invalid_argument(fmt::format("--timeline {}: cannot write: {}", out.string(), why));
  };
  if (out.filename().empty()) fail("not a file name");
  std::error_code ec;
  if (fs::is_directory(out, ec)) fail("it is a directory");
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) fail(std::strerror(errno));
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    const int saved = errno;
    if (std::fclose(f) != 0 || !ok) fail(std::strerror(ok ? errno : saved));
  }
  fs::rename(tmp, out, ec);
  if (ec) fail(ec.message());
}

}  // namespace cucache::replay
