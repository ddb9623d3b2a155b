// Snapshots in the schema of PyTorch's torch.cuda.memory._snapshot(), which its memory viewer
// (torch.cuda._memory_viz, pytorch.org/memory_viz) reads:
//
//   {"segments": [{device, address, total_size, allocated_size, active_size, requested_size,
//                  stream, segment_type: "small"|"large", segment_pool_id: [a, b], is_expandable,
//                  frames[, sleep_tag, asleep], blocks: [{address, size, requested_size,
//                                    state: "active_allocated"|"active_pending_free"|"inactive",
//                                    frames[, tag]}]}],
//    "device_traces": [[{action, addr (device_free for "oom"), size, stream, time_us, frames
//                        [, tag]}], ...one list per device]}
//
// Blocks tile their segment in address order; allocated_size sums the active_allocated blocks,
// active_size those and the active_pending_free ones, requested_size the callers' sizes of the
// active_allocated ones. Frames are [{filename, line, name}], innermost first.
#include <nlohmann/json.hpp>

#include "observe/observe_hub.hpp"

namespace cucache::detail {

namespace {

using nlohmann::json;

json frames_json(const std::shared_ptr<const backtrace>& bt) {
  json out = json::array();
  if (bt == nullptr) return out;
  for (const frame& f : symbolize(*bt)) {
    out.push_back({{"filename", f.filename}, {"line", f.line}, {"name", f.name}});
  }
  return out;
}

std::int64_t stream_id(stream_handle s) {
  return static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(s));
}

}  // namespace

std::string torch_snapshot_json(const std::vector<const device_allocator*>& by_device,
                                const observe_hub& hub) {
  json segments = json::array();
  json traces = json::array();
  for (std::size_t dev = 0; dev < by_device.size(); ++dev) {
    const device_allocator* a = by_device[dev];
    json trace = json::array();
    if (a == nullptr) {
      traces.push_back(std::move(trace));
      continue;
    }
    const auto live = hub.live(static_cast<int>(dev));
    for (const segment_view& seg : a->segments()) {
      json blocks = json::array();
      std::size_t allocated = 0;
      std::size_t active = 0;
      std::size_t requested = 0;
      for (const block_view& b : seg.blocks) {
        const char* state = b.st == block_view::state::allocated ? "active_allocated"
                            : b.st == block_view::state::pending ? "active_pending_free"
                                                                 : "inactive";
        if (b.st == block_view::state::allocated) {
          allocated += b.size;
          requested += b.requested;
        }
        if (b.st != block_view::state::free) active += b.size;
        json block = {{"address", b.address},
                      {"size", b.size},
                      {"requested_size", b.requested},
                      {"state", state}};
        const auto it = b.st == block_view::state::allocated ? live.find(b.address) : live.end();
        block["frames"] = it != live.end() ? frames_json(it->second.frames) : json::array();
        if (it != live.end() && it->second.tag != 0) block["tag"] = tag_name(it->second.tag);
        blocks.push_back(std::move(block));
      }
      json segment = {{"device", static_cast<int>(dev)},
                      {"address", seg.address},
                      {"total_size", seg.size},
                      {"allocated_size", allocated},
                      {"active_size", active},
                      {"requested_size", requested},
                      {"stream", stream_id(seg.stream)},
                      {"segment_type", seg.small ? "small" : "large"},
                      {"segment_pool_id", json::array({seg.pool.first, seg.pool.second})},
                      {"is_expandable", seg.expandable},
                      {"frames", json::array()},
                      {"blocks", std::move(blocks)}};
      // A sleepable tag's segment (docs/api.md, "Sleep and wake"): its tag, and whether it sleeps
      // (its blocks keep their addresses; no page of it is mapped).
      if (seg.sleep_domain != 0) {
        segment["sleep_tag"] = tag_name(seg.sleep_domain);
        segment["asleep"] = seg.asleep;
      }
      segments.push_back(std::move(segment));
    }
    for (const history_entry& e : hub.history(static_cast<int>(dev))) {
      json entry = {{"action", to_string(e.act)}};
      entry[e.act == history_entry::action::oom ? "device_free" : "addr"] = e.addr;
      entry["size"] = e.size;
      entry["stream"] = stream_id(e.stream);
      entry["time_us"] = e.time_us;
      entry["frames"] = frames_json(e.frames);
      if (e.tag != 0) entry["tag"] = tag_name(e.tag);
      trace.push_back(std::move(entry));
    }
    traces.push_back(std::move(trace));
  }
  return json{{"segments", std::move(segments)}, {"device_traces", std::move(traces)}}.dump();
}

std::string sleeping_json(const std::vector<sleep_stat>& tags) {
  json out = json::array();
  for (const sleep_stat& t : tags) {
    out.push_back({{"tag", t.tag},
                   {"bytes", t.bytes},
                   {"host_bytes", t.host_bytes},
                   {"copy_seconds", t.copy_seconds}});
  }
  return out.dump();
}

std::string tag_stats_json(const std::vector<tag_stat>& tags) {
  json out = json::array();
  for (const tag_stat& t : tags) {
    // Every field of CUCACHE_TAG_STAT_FIELDS under its member's name; a limit is null when none.
    json row = {{"tag", t.tag}};
#define CUCACHE_TAG_JSON_(member, ...) row[#member] = t.member;
    CUCACHE_TAG_STAT_FIELDS(CUCACHE_TAG_JSON_)
#undef CUCACHE_TAG_JSON_
    if (t.limit_bytes == k_no_tag_limit) row["limit_bytes"] = nullptr;
    out.push_back(std::move(row));
  }
  return out.dump();
}

std::string leak_report_json(const observe_hub& hub, std::uint64_t steps) {
  const std::uint64_t k = hub.leak_window(steps);
  json candidates = json::array();
  for (const leak_candidate& c : hub.leak_report(steps)) {
    json frames = json::array();
    for (const frame& f : c.frames) {
      frames.push_back({{"filename", f.filename}, {"line", f.line}, {"name", f.name}});
    }
    candidates.push_back({{"device", c.device},
                          {"address", c.address},
                          {"size", c.size},
                          {"stream", stream_id(c.stream)},
                          {"tag", c.tag},
                          {"step", c.step},
                          {"steps_alive", c.steps_alive},
                          {"frames", std::move(frames)}});
  }
  return json{{"step", hub.steps()}, {"steps", k}, {"candidates", std::move(candidates)}}.dump();
}

}  // namespace cucache::detail
