// snapshot_json(): every segment and block of a device allocator as JSON, for tools that draw
// memory maps or look for the source of fragmentation, written from the allocator's public
// take_snapshot(); and stats_json(), the statistics from the field table (cucache/stats.hpp),
// which the snapshot and cucache-replay --json carry.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "cucache/device_allocator.hpp"
#include "cucache/stats.hpp"

namespace cucache {

std::string stats_json(const device_stats& s) {
  using nlohmann::json;
  json out = json::object();
  for_each_stat(s, [&](const stat_field& field, const auto& value) {
    using value_type = std::decay_t<decltype(value)>;
    json& entry = out[std::string(field.name)];
    if constexpr (std::is_same_v<value_type, stat_array>) {
      for (std::size_t i = 0; i < k_stat_pools; ++i) {
        entry[std::string(k_stat_pool_names[i])] = {{"current", value[i].current},
                                                    {"peak", value[i].peak},
                                                    {"allocated", value[i].allocated},
                                                    {"freed", value[i].freed}};
      }
    } else {
      entry = value;
    }
  });
  return out.dump();
}

std::string device_allocator::snapshot_json() const {
  using nlohmann::json;
  const memory_snapshot snap = take_snapshot();
  json segments = json::array();
  for (const segment_view& seg : snap.segments) {
    json blocks = json::array();
    for (const block_view& b : seg.blocks) {
      const char* state = b.st == block_view::state::allocated ? "allocated"
                          : b.st == block_view::state::pending ? "pending"
                                                               : "free";
      blocks.push_back({{"address", b.address},
                        {"size", b.size},
                        {"requested_size", b.requested},
                        {"state", state}});
    }
    json entry = {{"id", seg.id},
                  {"address", seg.address},
                  {"size", seg.size},
                  {"pool", seg.small ? "small" : "large"},
                  {"stream", reinterpret_cast<std::uintptr_t>(seg.stream)},
                  {"expandable", seg.expandable},
                  {"blocks", std::move(blocks)}};
    if (seg.expandable) {
      // The virtual range's mapped runs, one per physical handle; the rest is unmapped.
      json mappings = json::array();
      std::size_t mapped = 0;
      for (const mapping_view& m : seg.mappings) {
        mappings.push_back({{"address", m.address}, {"size", m.size}, {"idle", m.idle}});
        mapped += m.size;
      }
      entry["page_bytes"] = seg.page_bytes;
      entry["mapped_bytes"] = mapped;
      entry["unmapped_bytes"] = seg.size - mapped;
      entry["mappings"] = std::move(mappings);
    }
    segments.push_back(std::move(entry));
  }
  json out = {{"device", device()},
              {"backend", backend().name()},
              {"stats", json::parse(stats_json(snap.stats))},
              {"segments", std::move(segments)}};
  return out.dump();
}

}  // namespace cucache
