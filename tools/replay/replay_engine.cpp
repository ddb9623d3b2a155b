// Replaying prepared traces through cucache and the peers, and rendering the results (see
// replay_engine.hpp).
#include "replay_engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <unordered_map>

#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/forwarding_backend.hpp"
#include "cucache/sim_backend.hpp"
#include "peers.hpp"
#include "progress.hpp"
#include "replay_loop.hpp"
#include "replay_setup.hpp"

namespace cucache::replay {

// --- shared with the other passes over a trace (replay_setup.hpp) --------------------------------

std::shared_ptr<device_backend> backend_for(const options& opts) {
  sim_options so;
  so.capacity_bytes = opts.capacity_bytes.value_or(k_unbounded_sim_capacity);
  // A replay has no kernels: the device is never busy, so cross-stream frees complete at once.
  so.events_complete_immediately = true;
  return make_backend(opts.backend, 0, so);
}

config effective_config(const options& opts) {
  config cfg = opts.cfg;
  if (opts.backend == backend_kind::cuda && opts.capacity_bytes) {
    cfg.memory_limit_bytes = cfg.memory_limit_bytes == 0
                                 ? *opts.capacity_bytes
                                 : std::min(cfg.memory_limit_bytes, *opts.capacity_bytes);
  }
  return cfg;
}

replay_streams::replay_streams(const prepared_trace& trace, backend_kind kind) {
  if (kind == backend_kind::sim) {
    for (const std::uintptr_t id : trace.stream_ids) {
      sim_.push_back(reinterpret_cast<stream_handle>(id));
    }
  } else {
    cuda_.emplace(trace.stream_ids);
  }
}

std::span<const stream_handle> replay_streams::handles() const noexcept {
  return cuda_ ? cuda_->handles() : std::span<const stream_handle>(sim_);
}

namespace {

// --- preparation ------------------------------------------------------------------------------

// --- the cucache side -------------------------------------------------------------------------

struct cucache_ops {
  device_allocator* a;
  // Sleep and wake rows (sleeping_allocator in replay_loop.hpp): the calls made and the most
  // device bytes asleep at once.
  std::uint64_t sleeps = 0;
  std::uint64_t wakes = 0;
  std::size_t peak_sleeping_bytes = 0;
  std::uint32_t domain = 0;  // the calling thread's sleep domain as this replay last set it

  ~cucache_ops() {
    if (domain != 0) device_allocator::set_thread_sleep_domain(0);
  }
  void set_domain(std::uint16_t d) {
    if (d == domain) return;
    device_allocator::set_thread_sleep_domain(d);
    domain = d;
  }
  void sleep(std::uint16_t d, bool keep_contents) {
    a->sleep(d, keep_contents);
    ++sleeps;
    peak_sleeping_bytes = std::max(peak_sleeping_bytes, a->stats().sleeping_bytes);
  }
  bool wake(std::uint16_t d) {
    try {
      a->wake(d);
    } catch (const out_of_memory&) {
      return false;  // counted by the pass; the tag stays asleep
    }
    ++wakes;
    return true;
  }
  bool asleep(std::uint16_t d) const { return a->is_asleep(d); }
  void* allocate(std::size_t bytes, stream_handle stream) {
    try {
      return a->allocate(bytes, stream);
    } catch (const out_of_memory&) {
      return nullptr;  // counted by the pass; the trace goes on without this block
    }
  }
  /// In the order of the row's stream, as RMM frees (cudaFreeAsync): on the block's own stream
  /// that is what the plain free does, and it also names the stream alive, so that the pool of
  /// a stream the trace no longer uses can be handed on (docs/design.md, "What a stream costs").
  void deallocate(void* p, stream_handle stream, bool /*other_stream*/) {
    a->deallocate(p, stream);
  }
};

/// Microseconds a VM call of `bytes` took on the H200 (see vm_call_model): measured at 2, 32 and
/// 256 MiB, interpolated on log2 of the size between them, the end figure outside.
double h200_us(const double (&at)[3], std::size_t bytes) {
  const double x = std::log2(static_cast<double>(std::max<std::size_t>(bytes, 1)) / (1 << 20));
  if (x <= 1.0) return at[0];                                      // 2 MiB
  if (x <= 5.0) return at[0] + (at[1] - at[0]) * (x - 1.0) / 4.0;  // 32 MiB
  if (x <= 8.0) return at[1] + (at[2] - at[1]) * (x - 5.0) / 3.0;  // 256 MiB
  return at[2];
}
constexpr double k_us_create[3] = {13.8, 13.4, 18.5};
constexpr double k_us_map[3] = {1.8, 1.8, 2.0};
constexpr double k_us_set_access[3] = {31.0, 46.9, 51.4};
constexpr double k_us_unmap[3] = {21.6, 28.5, 29.7};
constexpr double k_us_release[3] = {15.7, 34.9, 115.6};
constexpr double k_us_device_synchronize = 1.2;
constexpr double k_us_mem_get_info = 6.6;

/// Forwards every call (forwarding_backend) and counts successful segment creations, so the
/// sampling run can tell after which allocations reserved memory grew without taking the
/// allocator's locks each time; and counts the VM calls by kind with their modelled H200 cost
/// (vm_call_model). The replay is one thread, so plain counters do.
class counting_backend final : public forwarding_backend {
 public:
  using forwarding_backend::forwarding_backend;
  [[nodiscard]] std::uint64_t growths() const noexcept { return growths_; }
  [[nodiscard]] const vm_call_model& model() const noexcept { return model_; }
  /// The bytes of the segments and physical handles the allocator holds now: its reserved bytes,
  /// without a stats() call.
  [[nodiscard]] std::size_t reserved() const noexcept { return reserved_; }

  [[nodiscard]] void* segment_malloc(std::size_t bytes) override {
    void* p = forwarding_backend::segment_malloc(bytes);
    if (p != nullptr) {
      ++growths_;
      segment_bytes_[p] = bytes;
      reserved_ += bytes;
    }
    return p;
  }
  void segment_free(void* ptr) override {
    forwarding_backend::segment_free(ptr);
    if (const auto it = segment_bytes_.find(ptr); it != segment_bytes_.end()) {
      reserved_ -= it->second;
      segment_bytes_.erase(it);
    }
  }
  [[nodiscard]] std::optional<phys_handle> phys_create(std::size_t bytes) override {
    ++model_.create;
    model_.create_us += h200_us(k_us_create, bytes);
    auto h = forwarding_backend::phys_create(bytes);
    if (h) {
      ++growths_;
      handle_bytes_[*h] = bytes;
      reserved_ += bytes;
    }
    return h;
  }
  void phys_release(phys_handle handle) override {
    ++model_.release;
    const auto it = handle_bytes_.find(handle);
    model_.release_us += h200_us(k_us_release, it == handle_bytes_.end() ? 0 : it->second);
    forwarding_backend::phys_release(handle);
    if (it != handle_bytes_.end()) {
      reserved_ -= it->second;
      handle_bytes_.erase(it);
    }
  }
  void map(void* va, std::size_t bytes, phys_handle handle) override {
    ++model_.map;
    model_.map_us += h200_us(k_us_map, bytes);
    forwarding_backend::map(va, bytes, handle);
  }
  void unmap(void* va, std::size_t bytes) override {
    ++model_.unmap;
    model_.unmap_us += h200_us(k_us_unmap, bytes);
    forwarding_backend::unmap(va, bytes);
  }
  void set_access(void* va, std::size_t bytes) override {
    ++model_.set_access;
    model_.set_access_us += h200_us(k_us_set_access, bytes);
    forwarding_backend::set_access(va, bytes);
  }
  void device_synchronize() override {
    ++model_.device_synchronize;
    model_.device_synchronize_us += k_us_device_synchronize;
    forwarding_backend::device_synchronize();
  }
  [[nodiscard]] memory_info mem_get_info() override {
    ++model_.mem_get_info;
    model_.mem_get_info_us += k_us_mem_get_info;
    return forwarding_backend::mem_get_info();
  }

 private:
  std::uint64_t growths_ = 0;
  vm_call_model model_;
  std::unordered_map<phys_handle, std::size_t> handle_bytes_;
  std::unordered_map<void*, std::size_t> segment_bytes_;
  std::size_t reserved_ = 0;
};

memory_figures figures_of(const device_stats& s);

/// Wakes every tag a pass left asleep, so that its blocks can be freed (--warm).
void wake_all(device_allocator& a) {
  for (const device_allocator::sleep_state& st : a.sleeping()) a.wake(st.domain);
}

/// The figures of a cucache pass: the allocator's, and the sleeps the replay made.
memory_figures figures_of(const device_allocator& a, const cucache_ops& ops) {
  memory_figures f = figures_of(a.stats());
  f.sleeps = ops.sleeps;
  f.wakes = ops.wakes;
  f.peak_sleeping_bytes = ops.peak_sleeping_bytes;
  return f;
}

memory_figures figures_of(const device_stats& s) {
  memory_figures f;
  f.peak_reserved_bytes = static_cast<std::size_t>(s.reserved_bytes[0].peak);
  f.peak_allocated_bytes = static_cast<std::size_t>(s.allocated_bytes[0].peak);
  f.peak_requested_bytes = static_cast<std::size_t>(s.requested_bytes[0].peak);
  f.device_alloc_calls = s.device_alloc_count;
  f.device_free_calls = s.device_free_count;
  f.oom_count = s.oom_count;
  f.vm_map_calls = s.vm_map_count;
  f.vm_unmap_calls = s.vm_unmap_count;
  f.stitched_pages = s.stitched_pages;
  f.shared_pages = s.shared_pages;
  f.vm_sync_calls = s.vm_sync_count;
  f.vm_splits = s.vm_split_count;
  f.vm_reclaims = s.vm_reclaim_count;
  return f;
}

std::string describe(const memory_figures& f) {
  return fmt::format(
      "peak reserved {}, peak allocated {}, peak requested {}, device allocs {}, device frees {}, "
      "ooms {}, sleeps {}, wakes {} ({} refused), peak sleeping {}",
      f.peak_reserved_bytes, f.peak_allocated_bytes, f.peak_requested_bytes, f.device_alloc_calls,
      f.device_free_calls, f.oom_count, f.sleeps, f.wakes, f.failed_wakes, f.peak_sleeping_bytes);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2.0;
}

double per_op(std::chrono::nanoseconds elapsed, const prepared_trace& trace) {
  return trace.timed_events == 0
             ? 0.0
             : static_cast<double>(elapsed.count()) / static_cast<double>(trace.timed_events);
}

double ratio(double a, double b) {
  return b == 0.0 ? 0.0 : a / b;
}

std::string gib(std::size_t bytes) {
  return fmt::format("{:.3f} GiB", static_cast<double>(bytes) / static_cast<double>(1ULL << 30));
}

}  // namespace

// --- preparation ------------------------------------------------------------------------------

/// The most tags a replay can sleep: the allocator's sleep domains (1 .. 2^14 - 1).
constexpr std::size_t k_max_replay_domains = (std::size_t{1} << 14) - 1;

prepared_trace prepare(const std::vector<trace_event>& events, std::string name) {
  if (events.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument(fmt::format("{}: too many events ({})", name, events.size()));
  }
  prepared_trace t;
  t.name = std::move(name);
  t.summary = summarize(events);
  t.ops.resize(events.size());
  // The tags the trace sleeps get sleep domains, by first appearance.
  std::unordered_map<std::uint32_t, std::uint16_t> domains;  // trace tag id -> sleep domain
  for (const trace_event& ev : events) {
    if (ev.act != trace_event::action::sleep || domains.contains(ev.tag)) continue;
    if (t.sleep_tags.size() >= k_max_replay_domains) {
      throw invalid_argument(fmt::format("{}:{}: the trace sleeps more than {} tags, the most "
                                         "that can be sleepable",
                                         t.name, ev.line, k_max_replay_domains));
    }
    t.sleep_tags.emplace_back(trace_tag_name(ev.tag));
    domains.emplace(ev.tag, static_cast<std::uint16_t>(t.sleep_tags.size()));
  }
  const auto domain_of = [&](std::uint32_t tag) -> std::uint16_t {
    if (tag == 0 || domains.empty()) return 0;
    const auto it = domains.find(tag);
    return it == domains.end() ? 0 : it->second;
  };
  std::unordered_map<std::uintptr_t, std::uint32_t> live;  // trace pointer -> its allocate's slot
  std::unordered_map<std::uintptr_t, std::uint32_t> stream_index;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const trace_event& ev = events[i];
    replay_op& op = t.ops[i];
    const auto [sit, added] =
        stream_index.try_emplace(ev.stream, static_cast<std::uint32_t>(t.stream_ids.size()));
    if (added) t.stream_ids.push_back(ev.stream);
    op.stream = sit->second;
    const auto index = static_cast<std::uint32_t>(i);
    switch (ev.act) {
      case trace_event::action::allocate:
        ++t.timed_events;
        op.slot = index;
        if (ev.pointer == 0 || ev.size == 0) {
          // Nothing to replay (as summarize counts no bytes for it); a free of it is a no-op too.
          ++t.skipped_empty;
        } else {
          op.kind = op_kind::allocate;
          op.size = ev.size;
          op.domain = domain_of(ev.tag);
        }
        if (ev.pointer != 0) live[ev.pointer] = index;
        break;
      case trace_event::action::free: {
        ++t.timed_events;
        const auto it = live.find(ev.pointer);
        if (it == live.end()) break;  // a null pointer, or a free the reader let through
        const replay_op& alloc = t.ops[it->second];
        op.slot = it->second;
        if (alloc.kind == op_kind::allocate) {
          op.kind = alloc.stream == op.stream ? op_kind::free : op_kind::free_on_other_stream;
          op.domain = alloc.domain;
        }
        live.erase(it);
        break;
      }
      case trace_event::action::allocate_failure:
        ++t.skipped_failures;
        break;
      case trace_event::action::sleep:
        op.kind = ev.keep_contents ? op_kind::sleep_keep : op_kind::sleep;
        op.domain = domain_of(ev.tag);
        op.size = ev.size;
        if (t.sleeps++ == 0) t.first_sleep_line = ev.line;
        break;
      case trace_event::action::wake:
        op.kind = op_kind::wake;
        op.domain = domain_of(ev.tag);
        op.size = ev.size;
        ++t.wakes;
        if (op.domain == 0) {
          // The reader refuses a wake of a tag not asleep; events built by hand may not.
          throw invalid_argument(fmt::format("{}:{}: wake of tag '{}', which the trace never "
                                             "sleeps",
                                             t.name, ev.line, trace_tag_name(ev.tag)));
        }
        break;
    }
  }
  return t;
}

void check_sleep_replayable(const prepared_trace& trace, bool expandable, bool peers) {
  if (trace.sleeps == 0) return;
  if (!expandable) {
    throw invalid_argument(fmt::format(
        "{}:{}: the trace sleeps tag '{}', and sleep needs expandable segments (the API refuses "
        "it in default mode): replay with --config expandable_segments:True",
        trace.name, trace.first_sleep_line, trace.sleep_tags.front()));
  }
  if (peers) {
    throw invalid_argument(fmt::format(
        "{}:{}: the trace sleeps tag '{}', which the peers cannot replay (they have no sleep): "
        "replay it with --peers none",
        trace.name, trace.first_sleep_line, trace.sleep_tags.front()));
  }
}

std::string trace_name(const std::filesystem::path& path) {
  std::string name = path.filename().string();
  for (const std::string_view suffix : {".gz", ".csv", ".pickle"}) {
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      name.resize(name.size() - suffix.size());
    }
  }
  return name;
}

loaded_events read_events(const std::filesystem::path& path, std::optional<int> snapshot_device) {
  loaded_events out;
  if (!is_torch_snapshot(path)) {
    if (snapshot_device.has_value()) {
      throw invalid_argument(fmt::format(
          "--device {}: {} is a CSV trace, not a PyTorch memory snapshot (a trace has no "
          "devices to pick from)",
          *snapshot_device, path.string()));
    }
    out.events = read_trace(path);
    return out;
  }
  auto snap = std::make_shared<torch_snapshot_trace>(
      read_torch_snapshot(path, torch_snapshot_options{snapshot_device}));
  out.events = std::move(snap->events);
  snap->events.clear();
  out.note = snap->note();
  out.snapshot = std::move(snap);
  return out;
}

prepared_trace prepare(const loaded_events& loaded, std::string name) {
  prepared_trace t = prepare(loaded.events, std::move(name));
  t.source_note = loaded.note;
  t.snapshot = loaded.snapshot;
  return t;
}

prepared_trace load_trace(const std::filesystem::path& path, std::optional<int> snapshot_device) {
  return prepare(read_events(path, snapshot_device), trace_name(path));
}

// --- replay -----------------------------------------------------------------------------------

trace_result replay_trace(const prepared_trace& trace, const options& opts,
                          std::span<peer* const> peers) {
  if (opts.repeat == 0) throw invalid_argument("repeat must be at least 1");
  check_sleep_replayable(trace, opts.cfg.expandable_segments, !peers.empty());
  trace_result r;
  r.trace = trace.name;
  r.backend = to_string(opts.backend);
  r.config = to_string(opts.cfg);
  r.events = trace.summary.events;
  r.allocations = trace.summary.allocations;
  r.frees = trace.summary.frees;
  r.streams = trace.stream_ids.size();
  r.skipped_failures = trace.skipped_failures;
  r.peak_requested_bytes = trace.summary.peak_requested_bytes;
  r.capacity_bytes = opts.capacity_bytes;
  r.expandable = opts.cfg.expandable_segments;

  const bool sim = opts.backend == backend_kind::sim;
  const config cfg = effective_config(opts);
  const replay_streams stream_table(trace, opts.backend);
  const std::span<const stream_handle> streams = stream_table.handles();
  std::vector<void*> slots(trace.ops.size(), nullptr);

  // Timed runs: nothing but the allocator calls inside the clock.
  if (opts.warm) r.warm.emplace();
  for (unsigned run = 0; run < opts.repeat; ++run) {
    report(opts.progress_line, fmt::format("{}: run {}/{}", trace.name, run + 1, opts.repeat));
    std::fill(slots.begin(), slots.end(), nullptr);
    device_allocator a(backend_for(opts), cfg);
    cucache_ops ops{&a};
    const pass_result pass = run_pass(trace, streams, slots, ops);
    r.host_ns_per_op_runs.push_back(per_op(pass.elapsed, trace));
    memory_figures f = figures_of(a, ops);
    f.failed_wakes = pass.failed_wakes;
    // A refused wake is no allocation the allocator counts as out of memory.
    if (f.oom_count != pass.failed_allocations - pass.failed_wakes) {
      throw error(fmt::format("{}: the allocator counted {} out-of-memory errors, the replay {}",
                              trace.name, f.oom_count, pass.failed_allocations));
    }
    if (run == 0) {
      r.figures = f;
    } else if (sim && f != r.figures) {
      throw error(
          fmt::format("{}: the simulated replay is not deterministic: run 1 gave {}; run "
                      "{} gave {}",
                      trace.name, describe(r.figures), run + 1, describe(f)));
    }
    if (opts.warm) {
      // The second pass, through the cache the first one filled: what the first left live is
      // freed first, untimed (tags left asleep woken first).
      wake_all(a);
      for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] != nullptr) a.deallocate(slots[i]);
        slots[i] = nullptr;
      }
      const memory_figures before = figures_of(a.stats());
      const pass_result second = run_pass(trace, streams, slots, ops);
      r.warm->host_ns_per_op_runs.push_back(per_op(second.elapsed, trace));
      const memory_figures after = figures_of(a.stats());
      if (run == 0) {
        warm_figures& w = *r.warm;
        w.device_alloc_calls = after.device_alloc_calls - before.device_alloc_calls;
        w.device_free_calls = after.device_free_calls - before.device_free_calls;
        // In expandable mode the device allocations are the cuMemCreate calls.
        w.vm_create_calls = cfg.expandable_segments ? w.device_alloc_calls : 0;
        w.vm_map_calls = after.vm_map_calls - before.vm_map_calls;
        w.vm_unmap_calls = after.vm_unmap_calls - before.vm_unmap_calls;
        w.oom_count = after.oom_count - before.oom_count;
        w.peak_reserved_bytes = after.peak_reserved_bytes;
      }
    }
  }
  r.host_ns_per_op = median(r.host_ns_per_op_runs);
  if (r.warm) r.warm->host_ns_per_op = median(r.warm->host_ns_per_op_runs);

  // One untimed run samples the stats at the allocator's reserved peak: at the first growth
  // after which it holds the timed runs' peak reserved bytes (the backend counts what it holds, so
  // no stats() is taken before: a stats() at every growth walked every pool in use each time,
  // quadratic in the streams live at once). Where no growth reaches that peak (an allocation
  // that ran out of memory raised it on its way; a GPU run that went otherwise), a second run
  // samples at the first growth that reaches the highest value the first one saw.
  {
    report(opts.progress_line, fmt::format("{}: sampling the peak", trace.name));
    fragmentation_sample best;
    bool sampled = false;
    const auto take_sample = [&](device_allocator& a, const counting_backend& counting) {
      const device_stats s = a.stats();
      sampled = true;
      best.external = s.external_fragmentation();
      best.overhead = s.overhead_fragmentation();
      best.reserved_bytes = static_cast<std::size_t>(s.reserved_bytes[0].current);
      best.allocated_bytes = static_cast<std::size_t>(s.allocated_bytes[0].current);
      best.free_bytes = s.free_bytes;
      best.largest_free_block = s.largest_free_block;
      best.stats = s;
      if (best.reserved_bytes != counting.reserved()) {
        throw error(fmt::format("{}: the allocator reserves {} bytes, its backend holds {}",
                                trace.name, best.reserved_bytes, counting.reserved()));
      }
    };
    // Calls take_sample at the first growth after which reserved >= target; returns the highest
    // reserved seen after a growth.
    const auto sampling_callback = [&](device_allocator& a, const counting_backend& counting,
                                       std::size_t target, std::size_t& highest) {
      return [&a, &counting, target, &highest, &take_sample, &sampled,
              seen = std::uint64_t{0}](std::size_t) mutable {
        if (counting.growths() == seen) return;
        seen = counting.growths();
        highest = std::max(highest, counting.reserved());
        if (!sampled && counting.reserved() >= target) take_sample(a, counting);
      };
    };
    std::fill(slots.begin(), slots.end(), nullptr);
    auto counting = std::make_shared<counting_backend>(backend_for(opts));
    device_allocator a(counting, cfg);
    cucache_ops ops{&a};
    std::size_t highest = 0;
    const pass_result sampled_pass =
        run_pass(trace, streams, slots, ops,
                 sampling_callback(a, *counting, r.figures.peak_reserved_bytes, highest));
    if (!sampled && highest != 0) {
      std::vector<void*> again(slots.size(), nullptr);
      auto counting2 = std::make_shared<counting_backend>(backend_for(opts));
      device_allocator a2(counting2, cfg);
      cucache_ops ops2{&a2};
      std::size_t highest2 = 0;
      run_pass(trace, streams, again, ops2, sampling_callback(a2, *counting2, highest, highest2));
      wake_all(a2);
      for (void* slot : again) {
        if (slot != nullptr) a2.deallocate(slot);
      }
    }
    memory_figures f = figures_of(a, ops);
    f.failed_wakes = sampled_pass.failed_wakes;
    if (sim && f != r.figures) {
      throw error(fmt::format("{}: the sampling replay disagrees with the timed one: {} vs {}",
                              trace.name, describe(f), describe(r.figures)));
    }
    // An allocation that runs out of memory can raise reserved memory on its way (expandable
    // segments: handles made for a block that then cannot be backed in full) and is never
    // sampled, so the check holds only for replays without out-of-memory.
    if (sampled && f.oom_count == 0 && best.reserved_bytes != f.peak_reserved_bytes) {
      throw error(fmt::format("{}: sampled reserved peak {} differs from the allocator's {}",
                              trace.name, best.reserved_bytes, f.peak_reserved_bytes));
    }
    r.fragmentation_at_peak = best;
    r.vm_model = counting->model();
    r.stats = a.stats();
    if (r.warm) {
      // The second pass of the sampling run, through the same allocator: its driver calls are
      // the difference of the counts (figures only: the timed runs measured its host time).
      wake_all(a);
      for (void*& slot : slots) {
        if (slot != nullptr) a.deallocate(slot);
        slot = nullptr;
      }
      const vm_call_model before = counting->model();
      run_pass(trace, streams, slots, ops);
      r.warm->vm_model = counting->model() - before;
    }
  }

  // With one stream the allocator's requested peak is exact; with several it is a sum of
  // per-stream peaks, an upper bound. After an out-of-memory it misses the refused blocks.
  if (r.figures.oom_count == 0 && trace.stream_ids.size() <= 1 &&
      r.figures.peak_requested_bytes != r.peak_requested_bytes) {
    throw error(fmt::format("{}: peak requested bytes disagree: trace {}, allocator {}", trace.name,
                            r.peak_requested_bytes, r.figures.peak_requested_bytes));
  }
  r.reserved_over_requested = ratio(static_cast<double>(r.figures.peak_reserved_bytes),
                                    static_cast<double>(r.peak_requested_bytes));
  if (opts.capacity_bytes) r.fits = r.figures.oom_count == 0 && r.figures.failed_wakes == 0;

  for (peer* p : peers) {
    peer_result pr;
    pr.name = p->name();
    pr.peak_source = p->peak_source();
    p->begin_trace();
    if (opts.warm) pr.warm.emplace();
    for (unsigned run = 0; run < opts.repeat; ++run) {
      report(opts.progress_line,
             fmt::format("{}: {} run {}/{}", trace.name, p->name(), run + 1, opts.repeat));
      const peer_run pass = p->run(trace, streams, slots, opts.warm);
      pr.host_ns_per_op_runs.push_back(pass.ns_per_op);
      if (pr.warm) pr.warm->host_ns_per_op_runs.push_back(pass.warm_ns_per_op);
      if (run == 0) {
        pr.peak_reserved_bytes = pass.peak_reserved_bytes;
        pr.oom_count = pass.oom_count;
      }
    }
    pr.host_ns_per_op = median(pr.host_ns_per_op_runs);
    if (pr.warm) pr.warm->host_ns_per_op = median(pr.warm->host_ns_per_op_runs);
    r.peers.push_back(std::move(pr));
  }
  return r;
}

// --- minimum capacity (--fit) ------------------------------------------------------------------

namespace {

/// Bisection over limits k * q, k whole. `passes(limit)` replays under `limit`. Every limit below
/// `floor_bytes` (the peak requested bytes) fails without a replay: it cannot hold the bytes live
/// at that moment. `upper_bytes` (an unconstrained peak reserved) must pass; while it does not,
/// it is doubled, a few times at most.
template <class Passes>
capacity_fit bisect(std::size_t floor_bytes, std::size_t upper_bytes, std::size_t q,
                    Passes&& passes, const std::string& who) {
  constexpr unsigned k_max_raises = 4;
  capacity_fit f;
  auto tries = [&](std::size_t k) {
    ++f.replays;
    return passes(k * q);
  };
  std::size_t lo = (floor_bytes - 1) / q;  // the largest k with k * q < floor_bytes
  std::size_t hi = std::max(lo + 1, upper_bytes / q + (upper_bytes % q != 0 ? 1 : 0));
  bool lo_replayed = false;
  while (!tries(hi)) {
    if (f.upper_bound_raises == k_max_raises ||
        hi > std::numeric_limits<std::size_t>::max() / q / 2) {
      throw error(fmt::format(
          "{}: out of memory even under a limit of {} bytes, {} times its unconstrained peak "
          "reserved ({} bytes): no minimum capacity found",
          who, hi * q, 1u << f.upper_bound_raises, upper_bytes));
    }
    lo = hi;
    lo_replayed = true;
    hi *= 2;
    ++f.upper_bound_raises;
  }
  f.upper_bound_bytes = hi * q;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (tries(mid)) {
      hi = mid;
    } else {
      lo = mid;
      lo_replayed = true;
    }
  }
  f.min_capacity_bytes = hi * q;
  f.fails_at_bytes = lo * q;
  f.fails_at_replayed = lo_replayed;
  return f;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

namespace {

void check_resolution(const fit_options& fit) {
  if (fit.resolution_bytes == 0) {
    throw invalid_argument("--fit-resolution-mib: the resolution must be positive");
  }
}

/// What every fit needs of its inputs, whoever fits: a resolution and a trace that requests memory.
void check_fit_inputs(const prepared_trace& trace, const fit_options& fit) {
  check_resolution(fit);
  if (trace.summary.peak_requested_bytes == 0) {
    throw invalid_argument(fmt::format("--fit: {} requests no memory", trace.name));
  }
}

}  // namespace

void check_fit(const options& opts, const fit_options& fit) {
  check_resolution(fit);
  if (opts.capacity_bytes) {
    throw invalid_argument("--fit: sets the limit itself; give no --capacity-gib");
  }
  if (opts.cfg.memory_limit_bytes != 0 || opts.cfg.memory_fraction > 0.0) {
    throw invalid_argument(
        "--fit: sets the limit itself; give no memory_limit or memory_fraction in --config");
  }
}

namespace {

void require_limitable(const peer& p) {
  if (!p.limitable()) {
    throw invalid_argument(
        fmt::format("--fit: the peer {} cannot be held to a memory limit (--peers with --fit: "
                    "cudaMallocAsync, c10)",
                    p.name()));
  }
}

}  // namespace

capacity_fit fit_peer(const prepared_trace& trace, std::span<const stream_handle> streams,
                      std::span<void*> slots, peer& p, const fit_options& fit,
                      progress* progress_line) {
  check_fit_inputs(trace, fit);
  require_limitable(p);
  const auto start = std::chrono::steady_clock::now();
  p.begin_trace();
  const peer_run free_run = p.run(trace, streams, slots, /*warm=*/false);
  if (free_run.oom_count != 0) {
    throw error(
        fmt::format("--fit: {} runs out of memory without a limit ({})", trace.name, p.name()));
  }
  unsigned tried = 0;
  auto passes = [&](std::size_t limit) {
    report(progress_line, fmt::format("{}: fit of {}, replay {} under {}", trace.name, p.name(),
                                      ++tried, gib(limit)));
    return p.fits(trace, streams, slots, limit);
  };
  capacity_fit f =
      bisect(trace.summary.peak_requested_bytes, free_run.peak_reserved_bytes, fit.resolution_bytes,
             passes, fmt::format("{} ({})", trace.name, p.name()));
  f.unconstrained_peak_reserved_bytes = free_run.peak_reserved_bytes;
  f.seconds = seconds_since(start);
  return f;
}

fit_result fit_trace(const prepared_trace& trace, const options& opts, const fit_options& fit,
                     std::span<peer* const> peers) {
  check_fit(opts, fit);
  check_fit_inputs(trace, fit);
  check_sleep_replayable(trace, opts.cfg.expandable_segments, !peers.empty());
  for (const peer* p : peers) require_limitable(*p);  // before cucache's fit, not after it
  fit_result r;
  r.trace = trace.name;
  r.backend = to_string(opts.backend);
  r.config = to_string(opts.cfg);
  r.events = trace.summary.events;
  r.allocations = trace.summary.allocations;
  r.streams = trace.stream_ids.size();
  r.peak_requested_bytes = trace.summary.peak_requested_bytes;
  r.resolution_bytes = fit.resolution_bytes;

  const replay_streams stream_table(trace, opts.backend);
  const std::span<const stream_handle> streams = stream_table.handles();
  std::vector<void*> slots(trace.ops.size(), nullptr);

  // cucache: a fresh allocator per limit, the limit applied as --capacity-gib applies it.
  {
    const auto start = std::chrono::steady_clock::now();
    std::size_t upper = 0;
    {
      report(opts.progress_line, fmt::format("{}: fit, replay without a limit", trace.name));
      std::fill(slots.begin(), slots.end(), nullptr);
      device_allocator a(backend_for(opts), effective_config(opts));
      cucache_ops ops{&a};
      if (run_pass(trace, streams, slots, ops).failed_allocations != 0) {
        throw error(fmt::format("--fit: {} runs out of memory without a limit", trace.name));
      }
      upper = static_cast<std::size_t>(a.stats().reserved_bytes[0].peak);
    }
    unsigned tried = 0;
    auto passes = [&](std::size_t limit) {
      report(opts.progress_line,
             fmt::format("{}: fit, replay {} under {}", trace.name, ++tried, gib(limit)));
      options limited = opts;
      limited.capacity_bytes = limit;
      std::fill(slots.begin(), slots.end(), nullptr);
      device_allocator a(backend_for(limited), effective_config(limited));
      cucache_ops ops{&a};
      return run_pass<on_failure::stop>(trace, streams, slots, ops).failed_allocations == 0;
    };
    r.cucache = bisect(r.peak_requested_bytes, upper, fit.resolution_bytes, passes,
                       fmt::format("{} (cucache)", trace.name));
    r.cucache.unconstrained_peak_reserved_bytes = upper;
    r.cucache.seconds = seconds_since(start);
  }

  for (peer* p : peers) {
    r.peers.push_back({p->name(), fit_peer(trace, streams, slots, *p, fit, opts.progress_line)});
  }
  return r;
}

// --- output -----------------------------------------------------------------------------------

namespace {
nlohmann::json vm_calls_json(const vm_call_model& vm) {
  return {{"create", vm.create}, {"release", vm.release},       {"map", vm.map},
          {"unmap", vm.unmap},   {"set_access", vm.set_access}, {"total", vm.vm_calls()}};
}
nlohmann::json device_calls_json(const vm_call_model& vm) {
  return {{"device_synchronize", vm.device_synchronize}, {"mem_get_info", vm.mem_get_info}};
}
nlohmann::json vm_model_json(const vm_call_model& vm) {
  return {{"create", vm.create_us},
          {"release", vm.release_us},
          {"map", vm.map_us},
          {"unmap", vm.unmap_us},
          {"set_access", vm.set_access_us},
          {"device_synchronize", vm.device_synchronize_us},
          {"mem_get_info", vm.mem_get_info_us},
          {"total", vm.total_us()}};
}
/// VM calls per 1,000 trace events (a pass replays each event once).
double per_kilo_event(std::uint64_t calls, std::size_t events) {
  return events == 0 ? 0.0 : 1000.0 * static_cast<double>(calls) / static_cast<double>(events);
}
}  // namespace

nlohmann::json to_json(const trace_result& r) {
  nlohmann::json j;
  j["trace"] = r.trace;
  j["backend"] = r.backend;
  j["config"] = r.config;
  j["events"] = r.events;
  j["allocations"] = r.allocations;
  j["frees"] = r.frees;
  j["streams"] = r.streams;
  j["skipped_failures"] = r.skipped_failures;
  j["peak_requested_bytes"] = r.peak_requested_bytes;
  j["peak_reserved_bytes"] = r.figures.peak_reserved_bytes;
  j["peak_allocated_bytes"] = r.figures.peak_allocated_bytes;
  j["reserved_over_requested"] = r.reserved_over_requested;
  j["device_alloc_calls"] = r.figures.device_alloc_calls;
  j["device_free_calls"] = r.figures.device_free_calls;
  j["oom_count"] = r.figures.oom_count;
  // Counted at the backend in the sampling run (the allocator's stats count no set-access).
  j["vm_calls"] = vm_calls_json(r.vm_model);
  j["device_calls"] = device_calls_json(r.vm_model);
  // Modelled host time of those calls on the H200 (vm_call_model): an estimate, not a timing.
  j["vm_model_us"] = vm_model_json(r.vm_model);
  j["stitched_pages"] = r.figures.stitched_pages;
  j["shared_pages"] = r.figures.shared_pages;
  j["device_synchronizations"] = r.figures.vm_sync_calls;
  j["vm_splits"] = r.figures.vm_splits;
  j["vm_reclaims"] = r.figures.vm_reclaims;
  // Sleep and wake rows (cucache's trace extension) replayed, and the most bytes asleep at once.
  j["sleeps"] = r.figures.sleeps;
  j["wakes"] = r.figures.wakes;
  j["peak_sleeping_bytes"] = r.figures.peak_sleeping_bytes;
  j["failed_wakes"] = r.figures.failed_wakes;
  j["host_ns_per_op"] = r.host_ns_per_op;
  j["host_ns_per_op_runs"] = r.host_ns_per_op_runs;
  j["repeat"] = r.host_ns_per_op_runs.size();
  const fragmentation_sample& f = r.fragmentation_at_peak;
  j["fragmentation_at_peak"] = {{"external", f.external},
                                {"overhead", f.overhead},
                                {"reserved_bytes", f.reserved_bytes},
                                {"allocated_bytes", f.allocated_bytes},
                                {"free_bytes", f.free_bytes},
                                {"largest_free_block", f.largest_free_block}};
  // Every statistic, from the field table (cucache/stats.hpp): at the end of the sampling run
  // (the same figures as the timed runs on sim) and at its reserved peak.
  j["stats"] = nlohmann::json::parse(stats_json(r.stats));
  j["stats_at_reserved_peak"] = nlohmann::json::parse(stats_json(f.stats));
  if (r.capacity_bytes) j["capacity_bytes"] = *r.capacity_bytes;
  if (r.fits) j["fits"] = *r.fits;
  if (r.warm) {
    const warm_figures& w = *r.warm;
    const vm_call_model& wm = w.vm_model;
    j["warm"] = {{"host_ns_per_op", w.host_ns_per_op},
                 {"host_ns_per_op_runs", w.host_ns_per_op_runs},
                 {"device_alloc_calls", w.device_alloc_calls},
                 {"device_free_calls", w.device_free_calls},
                 {"vm_calls", vm_calls_json(wm)},
                 {"device_calls", device_calls_json(wm)},
                 {"device_synchronizations", wm.device_synchronize},
                 {"vm_model_us", vm_model_json(wm)},
                 {"oom_count", w.oom_count},
                 {"peak_reserved_bytes", w.peak_reserved_bytes}};
  }
  nlohmann::json peers = nlohmann::json::object();
  for (const peer_result& p : r.peers) {
    peers[p.name] = {
        {"host_ns_per_op", p.host_ns_per_op},
        {"host_ns_per_op_runs", p.host_ns_per_op_runs},
        {"peak_reserved_bytes", p.peak_reserved_bytes},
        {"peak_source", p.peak_source},
        {"reserved_over_requested", ratio(static_cast<double>(p.peak_reserved_bytes),
                                          static_cast<double>(r.peak_requested_bytes))},
        {"oom_count", p.oom_count},
        {"cucache_over_peer_reserved", ratio(static_cast<double>(r.figures.peak_reserved_bytes),
                                             static_cast<double>(p.peak_reserved_bytes))},
        {"cucache_over_peer_ns_per_op", ratio(r.host_ns_per_op, p.host_ns_per_op)},
    };
    if (p.warm) {
      peers[p.name]["warm"] = {
          {"host_ns_per_op", p.warm->host_ns_per_op},
          {"host_ns_per_op_runs", p.warm->host_ns_per_op_runs},
          {"cucache_over_peer_ns_per_op",
           ratio(r.warm ? r.warm->host_ns_per_op : 0.0, p.warm->host_ns_per_op)},
      };
    }
  }
  j["peers"] = std::move(peers);
  return j;
}

std::string format_table(std::span<const trace_result> results) {
  std::string s;
  if (results.empty()) return s;
  const trace_result& first = results.front();
  s += fmt::format("backend: {}   config: {}   repeat: {}\n", first.backend,
                   first.config.empty() ? "(defaults)" : first.config,
                   first.host_ns_per_op_runs.size());
  const bool capacity = first.capacity_bytes.has_value();
  s += fmt::format("{:<20} {:>8} {:>13} {:>13} {:>9} {:>10} {:>9} {:>9} {:>9}", "trace", "events",
                   "peak req", "peak resv", "resv/req", "dev alloc", "ns/op", "frag ext",
                   "frag ovh");
  if (capacity) s += fmt::format(" {:>5} {:>6}", "fits", "ooms");
  s += '\n';
  for (const trace_result& r : results) {
    s += fmt::format("{:<20} {:>8} {:>13} {:>13} {:>9.3f} {:>10} {:>9.1f} {:>9.3f} {:>9.3f}",
                     r.trace, r.events, gib(r.peak_requested_bytes),
                     gib(r.figures.peak_reserved_bytes), r.reserved_over_requested,
                     r.figures.device_alloc_calls, r.host_ns_per_op,
                     r.fragmentation_at_peak.external, r.fragmentation_at_peak.overhead);
    if (capacity)
      s += fmt::format(" {:>5} {:>6}", r.fits.value_or(false) ? "yes" : "no", r.figures.oom_count);
    s += '\n';
  }
  const bool sleeps = std::any_of(results.begin(), results.end(),
                                  [](const trace_result& r) { return r.figures.sleeps != 0; });
  if (sleeps) {
    s += fmt::format("\nsleep and wake (tags the trace sleeps)\n");
    s += fmt::format("{:<20} {:>8} {:>8} {:>13} {:>8}\n", "trace", "sleeps", "wakes",
                     "peak asleep", "refused");
    for (const trace_result& r : results) {
      s += fmt::format("{:<20} {:>8} {:>8} {:>13} {:>8}\n", r.trace, r.figures.sleeps,
                       r.figures.wakes, gib(r.figures.peak_sleeping_bytes),
                       r.figures.failed_wakes);
    }
  }
  if (first.warm) {
    s += fmt::format("\nwarm (second pass through the cache the first filled)\n");
    s += fmt::format("{:<20} {:>9} {:>9} {:>10} {:>10} {:>10} {:>13} {:>9} {:>9}\n", "trace",
                     "cold ns", "warm ns", "dev alloc", "dev free", "vm create", "peak resv",
                     "vm/1k ev", "vm/1k ev");
    s += fmt::format("{:<20} {:>9} {:>9} {:>10} {:>10} {:>10} {:>13} {:>9} {:>9}\n", "", "", "", "",
                     "", "", "", "(cold)", "(warm)");
    for (const trace_result& r : results) {
      if (!r.warm) continue;
      const warm_figures& w = *r.warm;
      s += fmt::format("{:<20} {:>9.1f} {:>9.1f} {:>10} {:>10} {:>10} {:>13} {:>9.2f} {:>9.2f}\n",
                       r.trace, r.host_ns_per_op, w.host_ns_per_op, w.device_alloc_calls,
                       w.device_free_calls, w.vm_create_calls, gib(w.peak_reserved_bytes),
                       per_kilo_event(r.vm_model.vm_calls(), r.events),
                       per_kilo_event(w.vm_model.vm_calls(), r.events));
    }
  }
  const bool any_peers = std::any_of(results.begin(), results.end(),
                                     [](const trace_result& r) { return !r.peers.empty(); });
  if (!any_peers) return s;
  s += fmt::format("\n{:<20} {:<16} {:>9} {:>13} {:>9} {:>14} {:>14} {:>6}\n", "trace", "peer",
                   "ns/op", "peak resv", "resv/req", "cucache/peer", "cucache/peer", "ooms");
  s += fmt::format("{:<20} {:<16} {:>9} {:>13} {:>9} {:>14} {:>14} {:>6}\n", "", "", "", "", "",
                   "(reserved)", "(ns/op)", "");
  for (const trace_result& r : results) {
    for (const peer_result& p : r.peers) {
      s += fmt::format("{:<20} {:<16} {:>9.1f} {:>13} {:>9.3f} {:>14.3f} {:>14.3f} {:>6}\n",
                       r.trace, p.name, p.host_ns_per_op, gib(p.peak_reserved_bytes),
                       ratio(static_cast<double>(p.peak_reserved_bytes),
                             static_cast<double>(r.peak_requested_bytes)),
                       ratio(static_cast<double>(r.figures.peak_reserved_bytes),
                             static_cast<double>(p.peak_reserved_bytes)),
                       ratio(r.host_ns_per_op, p.host_ns_per_op), p.oom_count);
    }
  }
  if (first.warm) {
    s += fmt::format("\n{:<20} {:<16} {:>12} {:>12} {:>14}\n", "trace", "peer", "warm ns/op",
                     "cucache warm", "cucache/peer");
    for (const trace_result& r : results) {
      for (const peer_result& p : r.peers) {
        if (!p.warm || !r.warm) continue;
        s += fmt::format("{:<20} {:<16} {:>12.1f} {:>12.1f} {:>14.3f}\n", r.trace, p.name,
                         p.warm->host_ns_per_op, r.warm->host_ns_per_op,
                         ratio(r.warm->host_ns_per_op, p.warm->host_ns_per_op));
      }
    }
  }
  return s;
}

namespace {

nlohmann::json fit_json(const capacity_fit& f, std::size_t peak_requested) {
  return {
      {"min_capacity_bytes", f.min_capacity_bytes},
      {"min_capacity_over_requested",
       ratio(static_cast<double>(f.min_capacity_bytes), static_cast<double>(peak_requested))},
      {"fails_at_bytes", f.fails_at_bytes},
      {"fails_at_replayed", f.fails_at_replayed},
      {"unconstrained_peak_reserved_bytes", f.unconstrained_peak_reserved_bytes},
      {"upper_bound_bytes", f.upper_bound_bytes},
      {"upper_bound_raises", f.upper_bound_raises},
      {"replays", f.replays},
      {"seconds", f.seconds},
  };
}

std::string mib(std::size_t bytes) {
  return fmt::format("{:g} MiB", static_cast<double>(bytes) / static_cast<double>(1ULL << 20));
}

}  // namespace

nlohmann::json to_json(const fit_result& r) {
  nlohmann::json j;
  j["mode"] = "fit";
  j["trace"] = r.trace;
  j["backend"] = r.backend;
  j["config"] = r.config;
  j["events"] = r.events;
  j["allocations"] = r.allocations;
  j["streams"] = r.streams;
  j["peak_requested_bytes"] = r.peak_requested_bytes;
  j["fit_resolution_bytes"] = r.resolution_bytes;
  j["fit_resolution_over_requested"] =
      ratio(static_cast<double>(r.resolution_bytes), static_cast<double>(r.peak_requested_bytes));
  j.update(fit_json(r.cucache, r.peak_requested_bytes));
  nlohmann::json peers = nlohmann::json::object();
  for (const peer_fit& p : r.peers) {
    nlohmann::json pj = fit_json(p.fit, r.peak_requested_bytes);
    pj["cucache_over_peer_min_capacity"] = ratio(static_cast<double>(r.cucache.min_capacity_bytes),
                                                 static_cast<double>(p.fit.min_capacity_bytes));
    peers[p.name] = std::move(pj);
  }
  j["peers"] = std::move(peers);
  return j;
}

std::string format_table(std::span<const fit_result> results) {
  std::string s;
  if (results.empty()) return s;
  const fit_result& first = results.front();
  s += fmt::format(
      "backend: {}   config: {}   minimum capacity by bisection, resolution {} (every limit "
      "tried is a multiple of it)\n",
      first.backend, first.config.empty() ? "(defaults)" : first.config,
      mib(first.resolution_bytes));
  const auto header = [&](const char* who) {
    s += fmt::format("{:<20} {:<16} {:>13} {:>13} {:>9} {:>13} {:>13} {:>9} {:>7} {:>8}\n", "trace",
                     who, "peak req", "min capacity", "min/req", "fails at", "unconstr resv",
                     "resv/req", "replays", "seconds");
  };
  const auto row = [&](const fit_result& r, const std::string& who, const capacity_fit& f) {
    const auto req = static_cast<double>(r.peak_requested_bytes);
    s += fmt::format("{:<20} {:<16} {:>13} {:>13} {:>9.4f} {:>13} {:>13} {:>9.4f} {:>7} {:>8.2f}\n",
                     r.trace, who, gib(r.peak_requested_bytes), gib(f.min_capacity_bytes),
                     ratio(static_cast<double>(f.min_capacity_bytes), req), gib(f.fails_at_bytes),
                     gib(f.unconstrained_peak_reserved_bytes),
                     ratio(static_cast<double>(f.unconstrained_peak_reserved_bytes), req),
                     f.replays, f.seconds);
  };
  header("allocator");
  for (const fit_result& r : results) {
    row(r, "cucache", r.cucache);
    for (const peer_fit& p : r.peers) row(r, p.name, p.fit);
  }
  for (const fit_result& r : results) {
    const auto raised = [&](const std::string& who, const capacity_fit& f) {
      if (f.upper_bound_raises == 0) return;
      s += fmt::format(
          "note: {} ({}): the unconstrained peak reserved failed as a limit; the "
          "upper bound was doubled {} time(s), to {}\n",
          r.trace, who, f.upper_bound_raises, gib(f.upper_bound_bytes));
    };
    raised("cucache", r.cucache);
    for (const peer_fit& p : r.peers) raised(p.name, p.fit);
  }
  return s;
}

}  // namespace cucache::replay
