// Replaying prepared traces through cucache and the peers, and rendering the results (see
// replay_engine.hpp).
#include "replay_engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <unordered_map>

#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "peers.hpp"
#include "replay_loop.hpp"

namespace cucache::replay {
namespace {

// --- preparation ------------------------------------------------------------------------------

std::string trace_name(const std::filesystem::path& path) {
  std::string name = path.filename().string();
  for (const std::string_view suffix : {".gz", ".csv"}) {
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      name.resize(name.size() - suffix.size());
    }
  }
  return name;
}

// --- the cucache side -------------------------------------------------------------------------

struct cucache_ops {
  device_allocator* a;
  void* allocate(std::size_t bytes, stream_handle stream) {
    try {
      return a->allocate(bytes, stream);
    } catch (const out_of_memory&) {
      return nullptr;  // counted by the pass; the trace goes on without this block
    }
  }
  void deallocate(void* p, stream_handle stream, bool other_stream) {
    if (other_stream) {
      a->deallocate(p, stream);
    } else {
      a->deallocate(p);
    }
  }
};

/// Forwards every call and counts successful segment creations, so the sampling run can tell
/// after which allocations reserved memory grew without taking the allocator's locks each time.
class counting_backend final : public device_backend {
 public:
  explicit counting_backend(std::shared_ptr<device_backend> inner) : inner_(std::move(inner)) {}
  [[nodiscard]] std::uint64_t growths() const noexcept { return growths_; }

  [[nodiscard]] int device() const noexcept override { return inner_->device(); }
  [[nodiscard]] const char* name() const noexcept override { return inner_->name(); }
  [[nodiscard]] void* segment_malloc(std::size_t bytes) override {
    void* p = inner_->segment_malloc(bytes);
    if (p != nullptr) ++growths_;
    return p;
  }
  void segment_free(void* ptr) override { inner_->segment_free(ptr); }
  [[nodiscard]] std::size_t vm_granularity() override { return inner_->vm_granularity(); }
  [[nodiscard]] void* va_reserve(std::size_t bytes) override { return inner_->va_reserve(bytes); }
  void va_free(void* base, std::size_t bytes) override { inner_->va_free(base, bytes); }
  [[nodiscard]] std::optional<phys_handle> phys_create(std::size_t bytes) override {
    auto h = inner_->phys_create(bytes);
    if (h) ++growths_;
    return h;
  }
  void phys_release(phys_handle handle) override { inner_->phys_release(handle); }
  void map(void* va, std::size_t bytes, phys_handle handle) override {
    inner_->map(va, bytes, handle);
  }
  void unmap(void* va, std::size_t bytes) override { inner_->unmap(va, bytes); }
  void set_access(void* va, std::size_t bytes) override { inner_->set_access(va, bytes); }
  [[nodiscard]] event_handle event_create() override { return inner_->event_create(); }
  void event_destroy(event_handle event) override { inner_->event_destroy(event); }
  void event_record(event_handle event, stream_handle stream) override {
    inner_->event_record(event, stream);
  }
  [[nodiscard]] bool event_query(event_handle event) override { return inner_->event_query(event); }
  void event_synchronize(event_handle event) override { inner_->event_synchronize(event); }
  void stream_wait_event(stream_handle stream, event_handle event) override {
    inner_->stream_wait_event(stream, event);
  }
  void stream_synchronize(stream_handle stream) override { inner_->stream_synchronize(stream); }
  void device_synchronize() override { inner_->device_synchronize(); }
  [[nodiscard]] memory_info mem_get_info() override { return inner_->mem_get_info(); }

 private:
  std::shared_ptr<device_backend> inner_;
  std::uint64_t growths_ = 0;
};

std::shared_ptr<device_backend> make_backend(const options& opts) {
  if (opts.backend == backend_kind::sim) {
    sim_options so;
    so.capacity_bytes = opts.capacity_bytes.value_or(k_unbounded_sim_capacity);
    // A replay has no kernels: the device is never busy, so cross-stream frees complete at once.
    so.events_complete_immediately = true;
    return std::make_shared<sim_backend>(so);
  }
  return std::make_shared<cuda_backend>(0);
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

memory_figures figures_of(const device_stats& s) {
  memory_figures f;
  f.peak_reserved_bytes = static_cast<std::size_t>(s.reserved_bytes[0].peak);
  f.peak_allocated_bytes = static_cast<std::size_t>(s.allocated_bytes[0].peak);
  f.peak_requested_bytes = static_cast<std::size_t>(s.requested_bytes[0].peak);
  f.device_alloc_calls = s.device_alloc_count;
  f.device_free_calls = s.device_free_count;
  f.oom_count = s.oom_count;
  f.vm_create_calls = s.vm_create_count;
  f.vm_release_calls = s.vm_release_count;
  f.vm_map_calls = s.vm_map_count;
  f.vm_unmap_calls = s.vm_unmap_count;
  f.stitched_pages = s.stitched_pages;
  return f;
}

std::string describe(const memory_figures& f) {
  return fmt::format(
      "peak reserved {}, peak allocated {}, peak requested {}, device allocs {}, device frees {}, "
      "ooms {}",
      f.peak_reserved_bytes, f.peak_allocated_bytes, f.peak_requested_bytes, f.device_alloc_calls,
      f.device_free_calls, f.oom_count);
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

prepared_trace prepare(const std::vector<trace_event>& events, std::string name) {
  if (events.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument(fmt::format("{}: too many events ({})", name, events.size()));
  }
  prepared_trace t;
  t.name = std::move(name);
  t.summary = summarize(events);
  t.ops.resize(events.size());
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
        }
        live.erase(it);
        break;
      }
      case trace_event::action::allocate_failure:
        ++t.skipped_failures;
        break;
    }
  }
  return t;
}

prepared_trace load_trace(const std::filesystem::path& path) {
  return prepare(read_trace(path), trace_name(path));
}

const char* to_string(backend_kind kind) noexcept {
  return kind == backend_kind::sim ? "sim" : "cuda";
}

// --- replay -----------------------------------------------------------------------------------

trace_result replay_trace(const prepared_trace& trace, const options& opts,
                          std::span<peer* const> peers) {
  if (opts.repeat == 0) throw invalid_argument("repeat must be at least 1");
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

  const bool sim = opts.backend == backend_kind::sim;
  const config cfg = effective_config(opts);
  std::optional<cuda_stream_table> cuda_streams;
  std::vector<stream_handle> sim_streams;
  std::span<const stream_handle> streams;
  if (sim) {
    // The simulated device takes any handle; the trace's own ids keep pools apart per stream.
    for (const std::uintptr_t id : trace.stream_ids) {
      sim_streams.push_back(reinterpret_cast<stream_handle>(id));
    }
    streams = sim_streams;
  } else {
    cuda_streams.emplace(trace.stream_ids);
    streams = cuda_streams->handles();
  }
  std::vector<void*> slots(trace.ops.size(), nullptr);

  // Timed runs: nothing but the allocator calls inside the clock.
  for (unsigned run = 0; run < opts.repeat; ++run) {
    std::fill(slots.begin(), slots.end(), nullptr);
    device_allocator a(make_backend(opts), cfg);
    cucache_ops ops{&a};
    const pass_result pass = run_pass(trace, streams, slots, ops);
    r.host_ns_per_op_runs.push_back(per_op(pass.elapsed, trace));
    const memory_figures f = figures_of(a.stats());
    if (f.oom_count != pass.failed_allocations) {
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
  }
  r.host_ns_per_op = median(r.host_ns_per_op_runs);

  // One untimed run samples the stats whenever reserved memory grew, keeping the sample where it
  // was highest: the allocator's state at its reserved peak.
  {
    std::fill(slots.begin(), slots.end(), nullptr);
    auto counting = std::make_shared<counting_backend>(make_backend(opts));
    device_allocator a(counting, cfg);
    cucache_ops ops{&a};
    std::uint64_t seen = 0;
    bool sampled = false;
    fragmentation_sample best;
    run_pass(trace, streams, slots, ops, [&](std::size_t) {
      if (counting->growths() == seen) return;
      seen = counting->growths();
      const device_stats s = a.stats();
      const auto reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
      if (sampled && reserved <= best.reserved_bytes) return;
      sampled = true;
      best.external = s.external_fragmentation();
      best.overhead = s.overhead_fragmentation();
      best.reserved_bytes = reserved;
      best.allocated_bytes = static_cast<std::size_t>(s.allocated_bytes[0].current);
      best.free_bytes = s.free_bytes;
      best.largest_free_block = s.largest_free_block;
    });
    const memory_figures f = figures_of(a.stats());
    if (sim && f != r.figures) {
      throw error(fmt::format("{}: the sampling replay disagrees with the timed one: {} vs {}",
                              trace.name, describe(f), describe(r.figures)));
    }
    if (sampled && best.reserved_bytes != f.peak_reserved_bytes) {
      throw error(fmt::format("{}: sampled reserved peak {} differs from the allocator's {}",
                              trace.name, best.reserved_bytes, f.peak_reserved_bytes));
    }
    r.fragmentation_at_peak = best;
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
  if (opts.capacity_bytes) r.fits = r.figures.oom_count == 0;

  for (peer* p : peers) {
    peer_result pr;
    pr.name = p->name();
    pr.peak_source = p->peak_source();
    p->begin_trace();
    for (unsigned run = 0; run < opts.repeat; ++run) {
      const peer_run pass = p->run(trace, streams, slots);
      pr.host_ns_per_op_runs.push_back(pass.ns_per_op);
      if (run == 0) {
        pr.peak_reserved_bytes = pass.peak_reserved_bytes;
        pr.oom_count = pass.oom_count;
      }
    }
    pr.host_ns_per_op = median(pr.host_ns_per_op_runs);
    r.peers.push_back(std::move(pr));
  }
  return r;
}

// --- output -----------------------------------------------------------------------------------

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
  j["vm_calls"] = {{"create", r.figures.vm_create_calls},
                   {"release", r.figures.vm_release_calls},
                   {"map", r.figures.vm_map_calls},
                   {"unmap", r.figures.vm_unmap_calls},
                   {"set_access", r.figures.vm_map_calls},
                   {"total", r.figures.vm_create_calls + r.figures.vm_release_calls +
                                 2 * r.figures.vm_map_calls + r.figures.vm_unmap_calls}};
  j["stitched_pages"] = r.figures.stitched_pages;
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
  if (r.capacity_bytes) j["capacity_bytes"] = *r.capacity_bytes;
  if (r.fits) j["fits"] = *r.fits;
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
  return s;
}

}  // namespace cucache::replay
