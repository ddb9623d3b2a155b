// The invariant checker of device_allocator: walks every pool, segment and block and compares the
// structures and the statistics against a recount. Used by the tests after every operation.
#include <fmt/format.h>

#include <map>
#include <stdexcept>
#include <unordered_set>

#include "allocator/allocator_impl.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;

namespace {
[[noreturn]] void violated(const std::string& what) {
  throw std::logic_error("cucache invariant violated: " + what);
}

/// An expandable segment: edge use counts equal a recount from the blocks, every touched page is
/// mapped, every mapping is consistent with the page table, idle means untouched, and a mapping
/// without access is idle (back() grants access before a block is handed out).
void check_range(const detail::stream_pool& p, const segment& s, std::int64_t& reserved,
                 std::int64_t& mappings, std::size_t& idle_seen, std::size_t& mapped_total) {
  const detail::vm_range& r = *s.vm;
  std::vector<std::uint32_t> edge(r.page_map.size(), 0);
  std::vector<std::uint32_t> use(r.page_map.size(), 0);
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (b->state == block_state::free) continue;
    const std::size_t first = r.page_of(b->addr);
    const std::size_t last = r.page_of(b->addr + b->size - 1);
    ++edge[first];
    if (last != first) ++edge[last];
    for (std::size_t pg = first; pg <= last; ++pg) ++use[pg];
  }
  std::size_t mapped_pages = 0;
  for (std::size_t pg = 0; pg < r.page_map.size(); ++pg) {
    if (edge[pg] != r.edge_use[pg]) {
      violated(fmt::format("range {:#x} page {}: edge count {} but {} blocks begin or end on it",
                           r.base, pg, r.edge_use[pg], edge[pg]));
    }
    if (use[pg] > 1 && edge[pg] != use[pg]) {
      violated(fmt::format("range {:#x} page {}: {} blocks touch it, not all at their edges",
                           r.base, pg, use[pg]));
    }
    const detail::vm_mapping* mp = r.page_map[pg];
    if (use[pg] > 0 && mp == nullptr) {
      violated(fmt::format("range {:#x} page {} is used by a block but not mapped", r.base, pg));
    }
    if (mp == nullptr) continue;
    ++mapped_pages;
    if (mp->range != &r || pg < mp->first_page || pg >= mp->first_page + mp->pages) {
      violated(fmt::format("range {:#x} page {}: mapping does not cover it", r.base, pg));
    }
    if (mp->first_page != pg) continue;
    if (mp->pages != 1) {  // the pager's rule: an idle page pins nothing but itself
      violated(fmt::format("range {:#x}: mapping at page {} spans {} pages, not one", r.base, pg,
                           mp->pages));
    }
    std::size_t used = 0;
    for (std::size_t i = 0; i < mp->pages; ++i) {
      if (r.page_map[pg + i] != mp) {
        violated(fmt::format("range {:#x}: mapping at page {} is torn", r.base, pg));
      }
      used += use[pg + i] > 0;
    }
    if (used != mp->used_pages || mp->idle != (used == 0)) {
      violated(
          fmt::format("range {:#x}: mapping at page {} counts {} used pages, recount {}, "
                      "idle {}",
                      r.base, pg, mp->used_pages, used, mp->idle));
    }
    if (!mp->accessible && !mp->idle) {
      violated(
          fmt::format("range {:#x}: mapping at page {} is used but has no access", r.base, pg));
    }
    idle_seen += mp->idle;
    reserved += static_cast<std::int64_t>(mp->pages * r.page_bytes);
    mappings += 1;
  }
  if (mapped_pages != r.mapped_pages) {
    violated(fmt::format("range {:#x}: {} pages mapped, counter says {}", r.base, mapped_pages,
                         r.mapped_pages));
  }
  mapped_total += mapped_pages * r.page_bytes;
  (void)p;
}

/// The pending queues: one per stream, entries of this pool's pending blocks, counted right, and
/// each block waiting on no more events than it has entries.
void check_pending_queues(const detail::stream_pool& p) {
  std::size_t entries = 0;
  const auto& queues = p.pending.queues();
  std::unordered_set<stream_handle> streams;
  for (std::size_t i = 0; i < queues.size(); ++i) {
    const auto& q = queues[i];
    if (!streams.insert(q.stream).second) {
      violated(fmt::format("pool {}: two pending queues for stream {}", p.index,
                           static_cast<const void*>(q.stream)));
    }
    if (q.head > q.items.size()) violated(fmt::format("pool {}: pending queue head", p.index));
    entries += q.items.size() - q.head;
  }
  if (entries != p.pending.size()) {
    violated(fmt::format("pool {}: pending queues hold {} entries, count says {}", p.index, entries,
                         p.pending.size()));
  }
  p.pending.for_each([&](const detail::pending_free& pf) {
    if (pf.b->state != block_state::pending || pf.b->seg->owner != &p) {
      violated(
          fmt::format("pool {}: pending entry for block {:#x}, which is not a pending block "
                      "of this pool",
                      p.index, pf.b->addr));
    }
  });
}
}  // namespace

void device_allocator::check_invariants() const {
  const impl& m = *impl_;
  auto all = m.pools.lock_all();
  std::size_t allocated_blocks = 0;
  std::size_t reserved_total = 0;
  std::size_t mapped_total = 0;
  for (const auto& pp : m.pools) {
    const detail::stream_pool& p = *pp;
    std::size_t free_count[2] = {0, 0};
    std::size_t free_bytes[2] = {0, 0};
    std::int64_t alloc_bytes[2] = {0, 0}, alloc_count[2] = {0, 0};
    std::int64_t active_bytes[2] = {0, 0}, active_count[2] = {0, 0};
    std::int64_t reserved[2] = {0, 0}, seg_count[2] = {0, 0}, requested[2] = {0, 0};
    std::size_t pending_blocks_events = 0;
    std::size_t idle_seen = 0;
    const segment* prev_seg = nullptr;
    for (const segment* s = p.segments; s != nullptr; s = s->next) {
      const int k = static_cast<int>(s->kind);
      if (s->prev != prev_seg) violated(fmt::format("segment {:#x}: broken segment list", s->base));
      prev_seg = s;
      if (s->owner != &p) violated(fmt::format("segment {:#x}: wrong owner", s->base));
      if (s->vm != nullptr) {
        std::int64_t mappings = 0;
        check_range(p, *s, reserved[k], mappings, idle_seen, mapped_total);
        seg_count[k] += mappings != 0;  // segment_count: ranges holding memory, not mappings
      } else {
        reserved[k] += static_cast<std::int64_t>(s->size);
        seg_count[k] += 1;
      }
      std::uintptr_t cursor = s->base;
      const block* prev = nullptr;
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->prev != prev) violated(fmt::format("block {:#x}: prev link broken", b->addr));
        if (b->seg != s) violated(fmt::format("block {:#x}: wrong segment", b->addr));
        if (b->addr != cursor) {
          violated(fmt::format("segment {:#x}: gap or overlap at {:#x} (block at {:#x})", s->base,
                               cursor, b->addr));
        }
        if (b->size == 0 || b->size % detail::k_min_block_bytes != 0) {
          violated(
              fmt::format("block {:#x}: size {} not a positive multiple of 512", b->addr, b->size));
        }
        switch (b->state) {
          case block_state::free:
            if (prev != nullptr && prev->state == block_state::free) {
              violated(fmt::format("blocks {:#x} and {:#x} are adjacent and both free", prev->addr,
                                   b->addr));
            }
            if (!p.free[k].contains(b)) {
              violated(fmt::format("free block {:#x} is not in its free index", b->addr));
            }
            ++free_count[k];
            free_bytes[k] += b->size;
            break;
          case block_state::allocated:
            if (m.blocks.find(b->addr) != b) {
              violated(fmt::format("allocated block {:#x} is not in the pointer map", b->addr));
            }
            if (b->requested == 0 || b->requested > b->size) {
              violated(fmt::format("block {:#x}: requested {} vs size {}", b->addr, b->requested,
                                   b->size));
            }
            ++allocated_blocks;
            alloc_bytes[k] += static_cast<std::int64_t>(b->size);
            alloc_count[k] += 1;
            requested[k] += static_cast<std::int64_t>(b->requested);
            active_bytes[k] += static_cast<std::int64_t>(b->size);
            active_count[k] += 1;
            break;
          case block_state::pending:
            if (b->uses == nullptr || b->uses->pending_events == 0) {
              violated(fmt::format("pending block {:#x} waits on no event", b->addr));
            }
            pending_blocks_events += b->uses->pending_events;
            active_bytes[k] += static_cast<std::int64_t>(b->size);
            active_count[k] += 1;
            break;
        }
        cursor += b->size;
        prev = b;
      }
      if (cursor != s->base + s->size) {
        violated(fmt::format("segment {:#x}: blocks cover {} of {} bytes", s->base,
                             cursor - s->base, s->size));
      }
    }
    std::size_t idle_listed = 0, idle_listed_bytes = 0;
    const detail::vm_mapping* idle_last = nullptr;
    for (const detail::vm_mapping* im = p.pages.idle_head; im != nullptr; im = im->idle_next) {
      if (im->idle_prev != idle_last) {
        violated(fmt::format("pool {}: idle list links are inconsistent", p.index));
      }
      idle_last = im;
      if (!im->idle || im->used_pages != 0) {
        violated(fmt::format("pool {}: a used mapping is on the idle list", p.index));
      }
      ++idle_listed;
      idle_listed_bytes += im->pages * m.page_bytes;
    }
    if (idle_last != p.pages.idle_tail) {
      violated(fmt::format("pool {}: idle list tail is not its last mapping", p.index));
    }
    if (idle_listed != idle_seen || idle_listed_bytes != p.pages.idle_bytes) {
      violated(
          fmt::format("pool {}: idle list holds {} mappings / {} bytes, page tables show {} "
                      "idle mappings, pool says {} bytes",
                      p.index, idle_listed, idle_listed_bytes, idle_seen, p.pages.idle_bytes));
    }
    if (pending_blocks_events != p.pending.size() + p.retained) {
      violated(
          fmt::format("pool {}: {} pending events recorded and {} retentions, blocks wait "
                      "on {}",
                      p.index, p.pending.size(), p.retained, pending_blocks_events));
    }
    check_pending_queues(p);
    for (int k = 0; k < 2; ++k) {
      // Bins hold blocks of their size class in strict (size, address) order: best fit relies on
      // it, and splits and merges re-link blocks in place.
      const block* last = nullptr;
      p.free[k].for_each([&](const block* b) {
        if (b->bin != detail::free_index::bin_of(b->size)) {
          violated(
              fmt::format("free block {:#x} of {} bytes is in bin {}", b->addr, b->size, b->bin));
        }
        if (last != nullptr && last->bin == b->bin &&
            !(last->size < b->size || (last->size == b->size && last->addr < b->addr))) {
          violated(fmt::format("bin {}: block {:#x} is listed before {:#x}", b->bin, last->addr,
                               b->addr));
        }
        last = b;
      });
      if (p.free[k].count() != free_count[k] || p.free[k].bytes() != free_bytes[k]) {
        violated(fmt::format("pool {} {}: free index holds {} blocks / {} bytes, segments {} / {}",
                             p.index, k == 0 ? "small" : "large", p.free[k].count(),
                             p.free[k].bytes(), free_count[k], free_bytes[k]));
      }
      const std::size_t slot = k == 0 ? 1 : 2;
      auto check = [&](const char* name, std::int64_t current, std::int64_t expect) {
        if (current != expect) {
          violated(fmt::format("pool {} {} {}: stat says {}, recount {}", p.index,
                               k == 0 ? "small" : "large", name, current, expect));
        }
      };
      const auto& st = p.stats;
      check("allocated_bytes", st.allocated_bytes[slot].current, alloc_bytes[k]);
      check("allocation_count", st.allocation_count[slot].current, alloc_count[k]);
      check("active_bytes", st.active_bytes(slot).current, active_bytes[k]);
      check("active_count", st.active_count(slot).current, active_count[k]);
      check("reserved_bytes", st.reserved_bytes[slot].current, reserved[k]);
      check("segment_count", st.segment_count[slot].current, seg_count[k]);
      check("requested_bytes", st.requested_bytes[slot].current, requested[k]);
    }
    reserved_total += static_cast<std::size_t>(reserved[0] + reserved[1]);
  }
  // Graph pools: retained blocks are pending blocks of the pool they name, and each pool's
  // retention count is right; parts belong to their graph pool.
  m.graphs.check_invariants();
  if (const std::string why = m.pools.check_map(); !why.empty()) violated(why);
  std::size_t handle_bytes = 0;
  if (m.pager) {
    std::lock_guard lock(m.budget.mu);
    for (const auto& [bytes, h] : m.pager->free_handles) handle_bytes += bytes;
    if (handle_bytes != m.pager->free_handle_bytes) {
      violated(fmt::format("unmapped handle list holds {} bytes, counter says {}", handle_bytes,
                           m.pager->free_handle_bytes));
    }
  }
  reserved_total += handle_bytes;
  (void)mapped_total;
  if (m.blocks.size() != allocated_blocks) {
    violated(fmt::format("pointer map holds {} blocks, {} are allocated", m.blocks.size(),
                         allocated_blocks));
  }
  const std::size_t reserved = m.budget.reserved_bytes();
  if (reserved != reserved_total) {
    violated(fmt::format("device reserved {} != sum of segments {}", reserved, reserved_total));
  }
  if (m.budget.limit != 0 && reserved > m.budget.limit) {
    violated(fmt::format("reserved {} exceeds the memory limit {}", reserved, m.budget.limit));
  }
}

}  // namespace cucache
