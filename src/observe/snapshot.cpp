// snapshot_json(): every segment and block of a device allocator as JSON, for tools that draw
// memory maps or look for the source of fragmentation; and stats_json(), the statistics from the
// field table (cucache/stats.hpp), which the snapshot and cucache-replay --json carry.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <vector>
#include <string>
#include <type_traits>

#include "allocator/allocator_impl.hpp"

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
  auto all = impl_->lock_all();
  const device_stats s = impl_->stats_locked();
  json segments = json::array();
  for (const auto& p : impl_->pools) {
    for (const detail::segment* seg = p->segments; seg != nullptr; seg = seg->next) {
      json blocks = json::array();
      for (const detail::block* b = seg->first; b != nullptr; b = b->next) {
        const char* state = b->state == detail::block_state::allocated ? "allocated"
                            : b->state == detail::block_state::pending ? "pending"
                                                                       : "free";
        blocks.push_back(
            {{"address", b->addr},
             {"size", b->size},
             {"requested_size",
              b->state == detail::block_state::allocated ? b->requested : std::size_t{0}},
             {"state", state}});
      }
      json entry = {{"id", seg->id},
                    {"address", seg->base},
                    {"size", seg->size},
                    {"pool", seg->kind == detail::pool_kind::small ? "small" : "large"},
                    {"stream", reinterpret_cast<std::uintptr_t>(p->stream)},
                    {"expandable", seg->vm != nullptr},
                    {"blocks", std::move(blocks)}};
      if (const detail::vm_range* r = seg->vm) {
        // The virtual range's mapped runs, one per physical handle; the rest is unmapped.
        json mappings = json::array();
        for (std::size_t pg = 0; pg < r->page_map.size(); ++pg) {
          const detail::vm_mapping* m = r->page_map[pg];
          if (m == nullptr || m->first_page != pg) continue;
          mappings.push_back({{"address", r->page_addr(pg)},
                              {"size", m->pages * r->page_bytes},
                              {"idle", m->idle}});
        }
        entry["page_bytes"] = r->page_bytes;
        entry["mapped_bytes"] = r->mapped_pages * r->page_bytes;
        entry["unmapped_bytes"] = r->size - r->mapped_pages * r->page_bytes;
        entry["mappings"] = std::move(mappings);
      }
      segments.push_back(std::move(entry));
    }
  }
  json out = {{"device", impl_->backend->device()},
              {"backend", impl_->backend->name()},
              {"stats", json::parse(stats_json(s))},
              {"segments", std::move(segments)}};
  return out.dump();
}

std::vector<segment_view> device_allocator::segments() const {
  auto all = impl_->lock_all();
  std::vector<segment_view> out;
  for (const auto& p : impl_->pools) {
    for (const detail::segment* seg = p->segments; seg != nullptr; seg = seg->next) {
      segment_view v;
      v.id = seg->id;
      v.address = seg->base;
      v.size = seg->size;
      v.small = seg->kind == detail::pool_kind::small;
      v.expandable = seg->vm != nullptr;
      v.stream = p->stream;
      if (p->graph != nullptr) v.pool = p->graph->id;
      for (const detail::block* b = seg->first; b != nullptr; b = b->next) {
        block_view bv;
        bv.address = b->addr;
        bv.size = b->size;
        bv.st = b->state == detail::block_state::allocated ? block_view::state::allocated
                : b->state == detail::block_state::pending ? block_view::state::pending
                                                           : block_view::state::free;
        bv.requested = bv.st == block_view::state::allocated ? b->requested : 0;
        v.blocks.push_back(bv);
      }
      out.push_back(std::move(v));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const segment_view& a, const segment_view& b) { return a.address < b.address; });
  return out;
}

}  // namespace cucache
