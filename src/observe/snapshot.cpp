// snapshot_json(): every segment and block of a device allocator as JSON, for tools that draw
// memory maps or look for the source of fragmentation.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <vector>

#include "allocator/allocator_impl.hpp"

namespace cucache {

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
              {"allocated_bytes", s.allocated_bytes[0].current},
              {"reserved_bytes", s.reserved_bytes[0].current},
              {"peak_reserved_bytes", s.reserved_bytes[0].peak},
              {"free_bytes", s.free_bytes},
              {"largest_free_block", s.largest_free_block},
              {"external_fragmentation", s.external_fragmentation()},
              {"overhead_fragmentation", s.overhead_fragmentation()},
              {"vm_calls",
               {{"create", s.vm_create_count},
                {"release", s.vm_release_count},
                {"map", s.vm_map_count},
                {"unmap", s.vm_unmap_count},
                {"stitched_pages", s.stitched_pages}}},
              {"unmapped_handle_bytes", s.unmapped_handle_bytes},
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
