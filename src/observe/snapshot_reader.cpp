// PyTorch memory snapshots read as allocation traces (include/cucache/snapshot_reader.hpp). The
// pickle is decoded by pickle_reader (plain data only); the rules that turn a device's trace
// entries into trace_event rows are docs/replay.md's ("PyTorch memory snapshots"):
//
// - "alloc" is an allocate of its size (PyTorch records the size the caller asked for) on its
//   stream. "free_requested" is the free: it is the caller's call, in stream order the moment
//   the block may be reused by later work on its own stream, which is what a trace row means and
//   what every replayed allocator reclaims by its own rules. "free_completed" is PyTorch's own
//   bookkeeping (the block back in its pool, later than the request only when record_stream made
//   it wait for other streams' work) and is not replayed; late ones are counted and said.
// - Allocations made before the history began (the ring of max_entries entries dropped their
//   alloc) are replayed as live at its start, by address: a block the history frees but never
//   allocated (size and stream from its free_requested), and a block active_allocated at the
//   dump that the history never saw (its requested size, its segment's stream).
// - "oom" is an allocate failure; segment and snapshot entries are the allocator's own doing.
#include "cucache/snapshot_reader.hpp"

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>

#include "cucache/errors.hpp"
#include "observe/pickle_reader.hpp"
#include "observe/trace_files.hpp"

namespace cucache {

namespace {

using detail::pickle_value;
using kind = pickle_value::kind;

/// The largest snapshot read: far above any real one (PyTorch's largest histories are a few
/// hundred MB), and below what the reader's 32-bit node indices can hold.
constexpr std::size_t k_max_snapshot_bytes = std::size_t{1} << 32;

constexpr std::string_view k_how_to_record =
    "record one with torch.cuda.memory._record_memory_history(max_entries=100000) before the "
    "work, then torch.cuda.memory._dump_snapshot(path) (docs/replay.md, \"PyTorch memory "
    "snapshots\")";

class converter {
 public:
  converter(std::string_view name, const torch_snapshot_options& opts) : name_(name), opts_(opts) {}

  torch_snapshot_trace run(const pickle_value& root) {
    out_.stacks.emplace_back();  // stacks[0]: none
    if (!root.is(kind::dict)) {
      throw invalid_argument(fmt::format(
          "{}: not a PyTorch memory snapshot: the pickle holds a {}, not a dict with "
          "'segments' and 'device_traces'",
          name_, root.type_name()));
    }
    const auto traces = root.get("device_traces");
    const auto segments = root.get("segments");
    if (!segments.has_value() && !traces.has_value()) {
      throw invalid_argument(fmt::format(
          "{}: not a PyTorch memory snapshot: its dict has neither 'segments' nor "
          "'device_traces'",
          name_));
    }
    if (traces.has_value() && !traces->is(kind::list)) {
      throw invalid_argument(
          fmt::format("{}: device_traces is a {}, not a list", name_, traces->type_name()));
    }
    const std::size_t devices = traces.has_value() ? traces->size() : 0;
    out_.devices = devices;
    std::vector<std::pair<int, std::size_t>> with_history;  // device, entries
    for (std::size_t d = 0; d < devices; ++d) {
      const pickle_value t = traces->at(d);
      if (!t.is(kind::list)) {
        throw invalid_argument(
            fmt::format("{}: device_traces[{}] is a {}, not a list", name_, d, t.type_name()));
      }
      if (t.size() > 0) with_history.emplace_back(static_cast<int>(d), t.size());
    }
    if (with_history.empty()) {
      throw invalid_argument(fmt::format(
          "{}: the snapshot has no allocation history (device_traces {}): it was dumped without "
          "recording one; {}",
          name_, devices == 0 ? "is missing or empty" : "holds no entry", k_how_to_record));
    }
    if (opts_.device.has_value()) {
      const int d = *opts_.device;
      if (d < 0 || static_cast<std::size_t>(d) >= devices) {
        throw invalid_argument(fmt::format("{}: device {}: the snapshot has device_traces for "
                                           "devices 0 to {}",
                                           name_, d, devices - 1));
      }
      if (traces->at(static_cast<std::size_t>(d)).size() == 0) {
        throw invalid_argument(fmt::format(
            "{}: device {} has no allocation history in the snapshot (devices with one: {}); "
            "if it allocated, {}",
            name_, d, list_devices(with_history), k_how_to_record));
      }
      out_.device = d;
    } else if (with_history.size() > 1) {
      throw invalid_argument(fmt::format(
          "{}: the snapshot has allocation histories for {} devices ({}): pick one "
          "(cucache-replay --device N, cucache.fit(path, device=N))",
          name_, with_history.size(), list_devices(with_history)));
    } else {
      out_.device = with_history.front().first;
    }
    if (segments.has_value()) read_segments(*segments);
    walk(traces->at(static_cast<std::size_t>(out_.device)));
    return std::move(out_);
  }

 private:
  static std::string list_devices(const std::vector<std::pair<int, std::size_t>>& ds) {
    std::string s;
    for (const auto& [d, n] : ds) {
      if (!s.empty()) s += ", ";
      s += fmt::format("{}: {} entries", d, n);
    }
    return s;
  }

  [[noreturn]] void bad(std::string_view where, std::string_view what) const {
    throw invalid_argument(fmt::format("{}: {}: {}", name_, where, what));
  }
  pickle_value field(const pickle_value& dict, std::string_view key, std::string_view where) const {
    const auto v = dict.get(key);
    if (!v.has_value()) bad(where, fmt::format("no '{}'", key));
    return *v;
  }
  std::uint64_t uint_field(const pickle_value& dict, std::string_view key,
                           std::string_view where) const {
    const pickle_value v = field(dict, key, where);
    const auto u = v.as_uint64();
    if (!u.has_value()) {
      bad(where, v.is(kind::integer)
                     ? fmt::format("'{}' is not an int from 0 to 2^64 - 1", key)
                     : fmt::format("'{}' is a {}, not an int", key, v.type_name()));
    }
    return *u;
  }
  /// A stream: PyTorch writes the cudaStream_t as a signed 64-bit int.
  std::uintptr_t stream_field(const pickle_value& dict, std::string_view where) const {
    const auto v = dict.get("stream");
    if (!v.has_value()) return 0;  // older snapshots: the default stream
    if (const auto u = v->as_uint64()) return static_cast<std::uintptr_t>(*u);
    if (const auto i = v->as_int64()) return static_cast<std::uintptr_t>(*i);
    bad(where, fmt::format("'stream' is a {}, not a 64-bit int", v->type_name()));
  }
  std::string_view str_field(const pickle_value& dict, std::string_view key,
                             std::string_view where) const {
    const pickle_value v = field(dict, key, where);
    if (!v.is(kind::string)) bad(where, fmt::format("'{}' is a {}, not a str", key, v.type_name()));
    return v.text();
  }

  /// The stack of a "frames" list (absent or empty: 0).
  std::uint32_t stack_of(const pickle_value& owner) {
    const auto frames = owner.get("frames");
    if (!frames.has_value() || !frames->is(kind::list) || frames->size() == 0) return 0;
    std::string key;  // the frame dicts' node indices: shared frames (PyTorch's) share a key
    key.reserve(frames->size() * 4);
    for (std::size_t i = 0; i < frames->size(); ++i) {
      const std::uint32_t idx = frames->at(i).index();
      key.append(reinterpret_cast<const char*>(&idx), sizeof idx);
    }
    const auto [it, added] =
        stack_ids_.try_emplace(std::move(key), static_cast<std::uint32_t>(out_.stacks.size()));
    if (!added) return it->second;
    std::vector<snapshot_frame> stack;
    for (std::size_t i = 0; i < frames->size(); ++i) {
      const pickle_value f = frames->at(i);
      if (!f.is(kind::dict)) continue;  // not what PyTorch writes; frames are only shown
      snapshot_frame fr;
      if (const auto v = f.get("filename"); v && v->is(kind::string)) fr.filename = v->text();
      if (const auto v = f.get("name"); v && v->is(kind::string)) fr.name = v->text();
      if (const auto v = f.get("line"); v) fr.line = v->as_int64().value_or(0);
      stack.push_back(std::move(fr));
    }
    out_.stacks.push_back(std::move(stack));
    return it->second;
  }

  void read_segments(const pickle_value& segments) {
    if (!segments.is(kind::list)) {
      throw invalid_argument(
          fmt::format("{}: segments is a {}, not a list", name_, segments.type_name()));
    }
    for (std::size_t i = 0; i < segments.size(); ++i) {
      const pickle_value s = segments.at(i);
      const std::string where = fmt::format("segments[{}]", i);
      if (!s.is(kind::dict)) bad(where, fmt::format("a {}, not a dict", s.type_name()));
      if (const auto dev = s.get("device"); dev.has_value() && dev->as_int64() != out_.device) {
        continue;
      }
      snapshot_segment seg;
      seg.address = uint_field(s, "address", where);
      seg.total_size = uint_field(s, "total_size", where);
      seg.stream = stream_field(s, where);
      if (const auto t = s.get("segment_type"); t && t->is(kind::string)) {
        seg.segment_type = t->text();
      }
      if (const auto e = s.get("is_expandable"); e) seg.is_expandable = e->as_bool();
      const pickle_value blocks = field(s, "blocks", where);
      if (!blocks.is(kind::list)) {
        bad(where, fmt::format("'blocks' is a {}, not a list", blocks.type_name()));
      }
      std::uintptr_t at = seg.address;  // blocks tile their segment in address order
      for (std::size_t j = 0; j < blocks.size(); ++j) {
        const pickle_value b = blocks.at(j);
        const std::string bwhere = fmt::format("segments[{}].blocks[{}]", i, j);
        if (!b.is(kind::dict)) bad(bwhere, fmt::format("a {}, not a dict", b.type_name()));
        snapshot_block blk;
        blk.size = uint_field(b, "size", bwhere);
        // PyTorch 2.1 and later write each block's address; older ones only the tiling.
        blk.address = b.get("address").has_value() ? uint_field(b, "address", bwhere) : at;
        at = blk.address + blk.size;
        blk.requested_size =
            b.get("requested_size").has_value() ? uint_field(b, "requested_size", bwhere) : blk.size;
        blk.state = str_field(b, "state", bwhere);
        blk.stack = stack_of(b);
        seg.blocks.push_back(std::move(blk));
      }
      out_.segments.push_back(std::move(seg));
    }
  }

  struct live_info {
    std::size_t event = 0;
    std::size_t size = 0;
  };
  struct pending_free {
    std::size_t allocs_at_request = 0;
  };

  void walk(const pickle_value& trace) {
    out_.entries = trace.size();
    std::vector<trace_event> before;       // allocations before the history began
    std::vector<std::uint32_t> before_stacks;
    std::unordered_map<std::uintptr_t, live_info> live;
    std::unordered_map<std::uintptr_t, pending_free> requested;  // freed, completion not seen
    std::unordered_map<std::uintptr_t, std::size_t> seen;        // address -> first entry
    std::vector<trace_event>& events = out_.events;
    std::vector<std::uint32_t>& stacks = out_.event_stacks;
    for (std::size_t i = 0; i < trace.size(); ++i) {
      const pickle_value e = trace.at(i);
      const auto where = [&] { return fmt::format("device_traces[{}][{}]", out_.device, i); };
      if (!e.is(kind::dict)) bad(where(), fmt::format("a {}, not a dict", e.type_name()));
      const std::string_view action = str_field(e, "action", where());
      trace_event ev;
      ev.line = i + 1;
      if (const auto t = e.get("time_us"); t.has_value()) {
        ev.time_us = t->as_uint64().value_or(0);
      }
      if (action == "alloc" || action == "free_requested" || action == "free_completed") {
        const std::uintptr_t addr = uint_field(e, "addr", where());
        const std::size_t size = uint_field(e, "size", where());
        ev.pointer = addr;
        ev.size = size;
        ev.stream = stream_field(e, where());
        const bool new_address = seen.try_emplace(addr, i + 1).second;
        if (action == "alloc") {
          if (addr == 0) bad(where(), "alloc of address 0");
          if (const auto it = live.find(addr); it != live.end()) {
            bad(where(), fmt::format("alloc of {:#x}, which is live (allocated at entry {} and "
                                     "not freed since)",
                                     addr, events[it->second.event].line));
          }
          ev.act = trace_event::action::allocate;
          live[addr] = {events.size(), size};
          requested.erase(addr);
          ++out_.allocs;
          events.push_back(ev);
          stacks.push_back(stack_of(e));
        } else if (action == "free_requested") {
          ++out_.frees;
          if (const auto it = live.find(addr); it != live.end()) {
            live.erase(it);
          } else if (new_address) {
            // Allocated before the history began: live from its start.
            trace_event b = ev;
            b.act = trace_event::action::allocate;
            b.line = 0;
            before.push_back(b);
            before_stacks.push_back(stack_of(e));
            ++out_.before_history_freed;
          } else {
            bad(where(), fmt::format("free_requested of {:#x}, which is not live (its last entry "
                                     "is {}, and no alloc since)",
                                     addr, last_entry_.at(addr)));
          }
          ev.act = trace_event::action::free;
          requested[addr] = {out_.allocs};
          events.push_back(ev);
          stacks.push_back(0);
        } else {  // free_completed
          ++out_.completions;
          if (const auto it = requested.find(addr); it != requested.end()) {
            if (out_.allocs != it->second.allocs_at_request) ++out_.late_completions;
            requested.erase(it);
          } else if (const auto lit = live.find(addr); lit != live.end()) {
            // No request seen for a live block: its completion is the only free there is.
            live.erase(lit);
            ++out_.completions_without_request;
            ev.act = trace_event::action::free;
            events.push_back(ev);
            stacks.push_back(0);
          } else if (new_address) {
            ++out_.completions_before_history;  // requested before the history began
          } else {
            bad(where(), fmt::format("free_completed of {:#x}, which is neither live nor "
                                     "waiting for its free to complete",
                                     addr));
          }
        }
        last_entry_[addr] = i + 1;
      } else if (action == "oom") {
        ev.act = trace_event::action::allocate_failure;
        ev.size = uint_field(e, "size", where());
        ev.stream = stream_field(e, where());
        ++out_.ooms;
        events.push_back(ev);
        stacks.push_back(stack_of(e));
      } else if (action == "segment_alloc" || action == "segment_free" ||
                 action == "segment_map" || action == "segment_unmap") {
        ++out_.segment_entries;
      } else if (action == "snapshot") {
        ++out_.snapshot_entries;
      } else {
        bad(where(), fmt::format("unknown action '{}' (PyTorch writes alloc, free_requested, "
                                 "free_completed, segment_alloc, segment_free, segment_map, "
                                 "segment_unmap, snapshot, oom)",
                                 action));
      }
    }
    out_.pending_at_dump = requested.size();
    // Blocks active at the dump that the history never saw: alive all along.
    for (const snapshot_segment& seg : out_.segments) {
      for (const snapshot_block& b : seg.blocks) {
        if (b.state != "active_allocated" || live.contains(b.address)) continue;
        // One the history freed (or a second block at one address): the segments disagree.
        if (!seen.try_emplace(b.address, 0).second) {
          ++out_.disagreeing_blocks;
          continue;
        }
        trace_event ev;
        ev.act = trace_event::action::allocate;
        ev.pointer = b.address;
        ev.size = b.requested_size;
        ev.stream = seg.stream;
        before.push_back(ev);
        before_stacks.push_back(b.stack);
        ++out_.before_history_alive;
      }
    }
    if (before.empty()) return;
    std::vector<std::size_t> order(before.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return before[a].pointer < before[b].pointer; });
    std::vector<trace_event> all;
    std::vector<std::uint32_t> all_stacks;
    all.reserve(before.size() + events.size());
    all_stacks.reserve(all.capacity());
    const std::uint64_t t0 = events.empty() ? 0 : events.front().time_us;
    for (const std::size_t k : order) {
      before[k].time_us = t0;
      all.push_back(before[k]);
      all_stacks.push_back(before_stacks[k]);
    }
    all.insert(all.end(), events.begin(), events.end());
    all_stacks.insert(all_stacks.end(), stacks.begin(), stacks.end());
    events = std::move(all);
    stacks = std::move(all_stacks);
  }

  std::string_view name_;
  const torch_snapshot_options& opts_;
  torch_snapshot_trace out_;
  std::unordered_map<std::string, std::uint32_t> stack_ids_;
  std::unordered_map<std::uintptr_t, std::size_t> last_entry_;  // address -> its last entry
};

}  // namespace

std::string torch_snapshot_trace::note() const {
  std::string s = fmt::format("PyTorch memory snapshot, device {} (of {} in device_traces): {} "
                              "entries: {} alloc, {} free_requested",
                              device, devices, entries, allocs, frees);
  if (ooms != 0) s += fmt::format(", {} oom (replayed as allocate failures)", ooms);
  const std::size_t before = before_history_freed + before_history_alive;
  if (before != 0) {
    s += fmt::format("; {} allocation{} made before the history began replayed as live at its "
                     "start ({} freed in it, {} active at the dump)",
                     before, before == 1 ? "" : "s", before_history_freed, before_history_alive);
  }
  if (completions != 0) {
    s += fmt::format("; {} free_completed not replayed (the free is the request)", completions);
    if (late_completions != 0) {
      s += fmt::format(", {} of them after later allocations (record_stream: PyTorch reused "
                       "those blocks later than the replay does)",
                       late_completions);
    }
  }
  if (pending_at_dump != 0) {
    s += fmt::format("; {} free_requested still waiting to complete at the dump (record_stream)",
                     pending_at_dump);
  }
  if (completions_without_request != 0) {
    s += fmt::format("; {} free_completed without a free_requested replayed as frees",
                     completions_without_request);
  }
  if (segment_entries + snapshot_entries != 0) {
    s += fmt::format("; {} segment and {} snapshot entries skipped (the allocator's own)",
                     segment_entries, snapshot_entries);
  }
  if (disagreeing_blocks != 0) {
    s += fmt::format("; {} block{} active at the dump but freed in the history (or listed twice) left out",
                     disagreeing_blocks, disagreeing_blocks == 1 ? "" : "s");
  }
  return s;
}

torch_snapshot_trace parse_torch_snapshot(std::string_view bytes, std::string_view name,
                                          const torch_snapshot_options& opts) {
  const detail::pickle_document doc = detail::parse_pickle(bytes, name);
  return converter(name, opts).run(doc.root());
}

bool is_torch_snapshot(const std::filesystem::path& path) {
  return detail::looks_like_pickle(detail::read_file_bytes(path, 2));
}

torch_snapshot_trace read_torch_snapshot(const std::filesystem::path& path,
                                         const torch_snapshot_options& opts) {
  const std::string bytes = detail::read_file_bytes(path, k_max_snapshot_bytes);
  if (bytes.size() >= k_max_snapshot_bytes) {
    throw invalid_argument(
        fmt::format("{}: the snapshot is 4 GiB or more decompressed, more than the reader takes",
                    path.string()));
  }
  return parse_torch_snapshot(bytes, path.string(), opts);
}

}  // namespace cucache
