// The segment walk of device_allocator: every segment and block, and in expandable mode every
// mapped run, as the public views (segment_view, memory_snapshot) the observe layer and the
// tools read -- the one place outside the allocation paths that walks the pools for them.
#include <algorithm>
#include <vector>

#include "allocator/allocator_impl.hpp"

namespace cucache {

namespace {

block_view::state state_of(const detail::block& b) {
  return b.state == detail::block_state::allocated ? block_view::state::allocated
         : b.state == detail::block_state::pending ? block_view::state::pending
                                                   : block_view::state::free;
}

/// Every segment of every pool, by pool in creation order, each pool's newest first.
std::vector<segment_view> walk(const device_allocator::impl& m) REQUIRES(detail::every_pool) {
  std::vector<segment_view> out;
  for (const auto& p : m.pools) {
    detail::pool_table::assert_locked(*p);
    for (const detail::segment* seg = p->segments; seg != nullptr; seg = seg->next) {
      segment_view v;
      v.id = seg->id;
      v.address = seg->base;
      v.size = seg->size;
      v.small = seg->kind == detail::pool_kind::small;
      v.expandable = seg->vm != nullptr;
      v.stream = p->stream;
      if (p->graph != nullptr) v.pool = p->graph->id;
      v.sleep_domain = p->domain;
      v.asleep = p->domain != 0 && m.sleeper.asleep(p->domain);
      for (const detail::block* b = seg->first; b != nullptr; b = b->next) {
        block_view bv;
        bv.address = b->addr;
        bv.size = b->size;
        bv.st = state_of(*b);
        bv.requested = bv.st == block_view::state::allocated ? b->requested : 0;
        v.blocks.push_back(bv);
      }
      if (const detail::vm_range* r = seg->vm) {
        v.page_bytes = r->page_bytes;
        r->pages.for_each([&](std::size_t pg, const detail::vm_page& e) {
          if (e.chunk_index != 0) return;  // a chunk is one mapping, listed at its first page
          const detail::page_span span = r->mapping_of(pg);
          v.mappings.push_back({r->page_addr(pg), span.pages() * r->page_bytes, r->all_idle(span)});
        });
      }
      out.push_back(std::move(v));
    }
  }
  return out;
}

}  // namespace

memory_snapshot device_allocator::take_snapshot() const {
  detail::lock_guard reader(impl_->ledger.readers);
  detail::pool_table::all_locked all(impl_->pools);
  memory_snapshot s;
  s.stats = impl_->ledger.read_locked(impl_->ledger_parts());
  s.segments = walk(*impl_);
  return s;
}

std::vector<segment_view> device_allocator::segments() const {
  std::vector<segment_view> out;
  {
    detail::pool_table::all_locked all(impl_->pools);
    out = walk(*impl_);
  }
  std::sort(out.begin(), out.end(),
            [](const segment_view& a, const segment_view& b) { return a.address < b.address; });
  return out;
}

}  // namespace cucache
