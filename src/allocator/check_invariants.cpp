// The invariant check of device_allocator: walks every pool, segment and block, compares the
// structures and the statistics against a recount, and composes the parts' own checks with the
// sums it counted (docs/design.md, "Invariants"). The tests call it after every operation.
#include <fmt/format.h>
#include <algorithm>

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

/// An expandable segment: edge use counts equal a recount from the blocks (and are stored only
/// where nonzero), every touched page is mapped, the runs of mapped pages are the maximal runs of
/// the page table, the idle runs are disjoint and hold exactly the mapped pages no block touches,
/// and a page without access is idle (back() grants access before a block is handed out). A chunk
/// (a handle of several pages) is recorded consistently on consecutive pages, and is either idle
/// as a whole or lies within the pages that one live block covers whole -- unless a carve of the
/// pool straddled a chunk (pool_pages::straddles, `straddles`); no chunk is larger than the
/// pager makes them (`max_chunk_pages`: pager::largest_chunk_pages).
/// (The pool's idle list against these tables: pager::check_invariants.) In a sleeping pool
/// (`asleep`) no page is mapped at all, and the pages its blocks touch are counted in
/// `sleeping_pages` instead.
void check_range(const detail::stream_pool& p, const segment& s, std::int64_t& reserved,
                 std::int64_t& mappings, bool asleep, std::size_t& sleeping_pages,
                 std::uint64_t straddles, std::size_t max_chunk_pages) REQUIRES(p.mu) {
  const detail::vm_range& r = *s.vm;
  if (r.page_count != r.size / r.page_bytes) {
    violated(fmt::format("range {:#x}: {} pages, size says {}", r.base, r.page_count,
                         r.size / r.page_bytes));
  }
  std::vector<std::uint32_t> edge(r.page_count, 0);
  std::vector<std::uint32_t> use(r.page_count, 0);
  std::vector<const block*> whole_owner(r.page_count, nullptr);  // the live block covering it whole
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (b->state == block_state::free) continue;
    const std::size_t first = r.page_of(b->addr);
    const std::size_t last = r.page_of(b->addr + b->size - 1);
    ++edge[first];
    if (last != first) ++edge[last];
    for (std::size_t pg = first; pg <= last; ++pg) ++use[pg];
    const detail::page_span whole = r.whole_pages(b->addr, b->size);
    for (std::size_t pg = whole.first; pg < whole.end; ++pg) whole_owner[pg] = b;
  }
  std::size_t edge_pages = 0;
  for (std::size_t pg = 0; pg < r.page_count; ++pg) {
    if (edge[pg] != r.edge(pg)) {
      violated(fmt::format("range {:#x} page {}: edge count {} but {} blocks begin or end on it",
                           r.base, pg, r.edge(pg), edge[pg]));
    }
    edge_pages += edge[pg] != 0;
    if (use[pg] > 1 && edge[pg] != use[pg]) {
      violated(fmt::format("range {:#x} page {}: {} blocks touch it, not all at their edges",
                           r.base, pg, use[pg]));
    }
    if (asleep) {
      if (r.mapped(pg)) {
        violated(fmt::format("range {:#x} page {} of a sleeping pool is mapped", r.base, pg));
      }
      sleeping_pages += use[pg] > 0;
      continue;
    }
    if (use[pg] > 0 && !r.mapped(pg)) {
      violated(fmt::format("range {:#x} page {} is used by a block but not mapped", r.base, pg));
    }
  }
  std::size_t edge_entries = 0;
  r.edge_use.for_each([&](std::size_t, std::uint32_t) { ++edge_entries; });
  if (edge_entries != edge_pages) {
    violated(fmt::format("range {:#x}: {} edge entries stored, {} pages are block edges", r.base,
                         edge_entries, edge_pages));
  }
  // The page table against the runs of mapped pages, and the idle runs against the recount.
  std::map<std::size_t, std::size_t> runs;
  std::size_t mapped_pages = 0, no_access = 0, run_first = 0, run_end = 0, chunks = 0;
  r.pages.for_each([&](std::size_t pg, const detail::vm_page& e) {
    if (!e.mapped) violated(fmt::format("range {:#x} page {}: entry not mapped", r.base, pg));
    if (e.chunk_pages != 0 && e.chunk_index == 0) {  // a chunk's first page: check it whole
      ++chunks;
      bool idle_all = true, one_owner = whole_owner[pg] != nullptr;
      if (e.chunk_pages < 2 || e.chunk_pages > max_chunk_pages ||
          pg + e.chunk_pages > r.page_count) {
        violated(fmt::format("range {:#x}: chunk at page {} of {} pages is malformed", r.base, pg,
                             e.chunk_pages));
      }
      for (std::size_t q = pg; q < pg + e.chunk_pages; ++q) {
        const detail::vm_page c = r.pages.get(q);
        if (!c.mapped || c.handle != e.handle || c.chunk_pages != e.chunk_pages ||
            c.chunk_index != q - pg || c.accessible != e.accessible) {
          violated(fmt::format("range {:#x}: page {} disagrees with the chunk at page {}", r.base,
                               q, pg));
        }
        idle_all = idle_all && use[q] == 0;
        one_owner = one_owner && whole_owner[q] == whole_owner[pg];
      }
      if (!idle_all && !one_owner && straddles == 0) {
        violated(
            fmt::format("range {:#x}: the chunk at page {} is touched, but not as a whole by "
                        "one block",
                        r.base, pg));
      }
    } else if (e.chunk_pages != 0 && (pg < e.chunk_index || !r.mapped(pg - e.chunk_index) ||
                                      r.pages.get(pg - e.chunk_index).chunk_index != 0)) {
      violated(fmt::format("range {:#x}: page {} of a chunk without its first page", r.base, pg));
    }
    ++mapped_pages;
    if (run_end != pg) {
      if (run_end != 0) runs.emplace(run_first, run_end);
      run_first = pg;
    }
    run_end = pg + 1;
    const bool idle = r.idle(pg);
    if (idle != (use[pg] == 0)) {
      violated(fmt::format("range {:#x} page {}: {} blocks touch it, idle runs say {}", r.base, pg,
                           use[pg], idle ? "idle" : "not idle"));
    }
    if (!e.accessible) {
      ++no_access;
      if (!idle) {
        violated(fmt::format("range {:#x}: page {} is used but has no access", r.base, pg));
      }
    }
    reserved += static_cast<std::int64_t>(r.page_bytes);
    mappings += 1;
  });
  if (chunks != r.chunks) {
    violated(
        fmt::format("range {:#x}: {} chunks mapped, counter says {}", r.base, chunks, r.chunks));
  }
  if (run_end != 0) runs.emplace(run_first, run_end);
  if (runs != r.mapped_runs) {
    violated(fmt::format("range {:#x}: {} runs of mapped pages recorded, the page table has {}",
                         r.base, r.mapped_runs.size(), runs.size()));
  }
  if (mapped_pages != r.mapped_pages || no_access != r.no_access_pages) {
    violated(fmt::format("range {:#x}: {} pages mapped ({} without access), counters say {} ({})",
                         r.base, mapped_pages, no_access, r.mapped_pages, r.no_access_pages));
  }
  std::size_t prev_end = 0;
  std::size_t idle_runs_seen = 0;
  r.idle_runs.for_each([&](const detail::idle_run* u) {
    ++idle_runs_seen;
    const std::size_t first = u->first;
    if (u->range != &r || u->end <= u->first || u->first < prev_end || u->end > r.page_count ||
        r.idle_runs.holding(u->end - 1) != u) {
      violated(
          fmt::format("range {:#x}: idle run at page {} is malformed or overlaps", r.base, first));
    }
    if (!r.all_mapped(u->first, u->end - 1)) {
      violated(
          fmt::format("range {:#x}: idle run at page {} holds an unmapped page", r.base, first));
    }
    if (r.idle_owner != &p.pages) {
      violated(fmt::format("range {:#x}: idle runs not owned by pool {}", r.base, p.index));
    }
    prev_end = u->end;
  });
  if (idle_runs_seen != r.idle_runs.size()) {
    violated(fmt::format("range {:#x}: {} idle runs indexed, {} counted", r.base,
                         r.idle_runs.size(), idle_runs_seen));
  }
  // The parked span (the pool's most recently idle pages, outside the runs): named by the pool
  // exactly when not empty, mapped, disjoint from every idle run.
  const bool parked = r.parked_end != r.parked_first;
  if (parked != (p.pages.parked() == &r)) {
    violated(fmt::format("range {:#x}: parked span [{}, {}) but pool {} {} it", r.base,
                         r.parked_first, r.parked_end, p.index,
                         p.pages.parked() == &r ? "names" : "does not name"));
  }
  if (parked) {
    if (r.parked_end < r.parked_first || r.parked_end > r.page_count ||
        !r.all_mapped(r.parked_first, r.parked_end - 1) || r.idle_owner != &p.pages) {
      violated(
          fmt::format("range {:#x}: parked span [{}, {}) is malformed, unmapped or not "
                      "owned by pool {}",
                      r.base, r.parked_first, r.parked_end, p.index));
    }
    const detail::idle_run* met = r.idle_runs.first_meeting(r.parked_first);
    if (met != nullptr && met->first < r.parked_end) {
      violated(fmt::format("range {:#x}: parked span [{}, {}) overlaps an idle run", r.base,
                           r.parked_first, r.parked_end));
    }
  }
}

/// The pending queues: one per stream, entries of this pool's pending blocks, counted right, and
/// each block waiting on no more events than it has entries.
void check_pending_queues(const detail::stream_pool& p) REQUIRES(p.mu) {
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

/// What the walk of one pool's segments counts, per pool kind, against its free index and its
/// statistics; and the device-wide sums the parts' own checks are given.
struct pool_recount {
  std::size_t free_count[2] = {0, 0};
  std::size_t free_bytes[2] = {0, 0};
  std::int64_t alloc_bytes[2] = {0, 0}, alloc_count[2] = {0, 0};
  std::int64_t active_bytes[2] = {0, 0}, active_count[2] = {0, 0};
  std::int64_t reserved[2] = {0, 0}, seg_count[2] = {0, 0}, requested[2] = {0, 0};
  std::size_t pending_events = 0;  // the events the pool's pending blocks wait on
};
struct device_recount {
  std::size_t allocated_blocks = 0;
  std::size_t segments = 0;       // every pool's
  std::size_t reserved = 0;       // segments' memory and mapped pages, every pool
  std::size_t address_bytes = 0;  // the address space of every range
  std::map<std::uint32_t, std::size_t> sleeping_pages;  // by domain: pages its blocks touch
  std::map<std::uint32_t, std::size_t> sleeping_graph;  // by domain: whole-VM graph bytes
};

/// The memory behind segment s of p: an expandable range's pages (check_range), or a segment
/// that is wholly memory -- cudaMalloc'd, or whole-VM graph memory of a sleepable tag, which
/// holds none while unmapped (and only its domain's sleep unmaps it).
void check_segment_memory(const detail::stream_pool& p, const segment& s,
                          const detail::tag_sleeper& sleeper, const detail::pager* pg,
                          bool expandable, pool_recount& rc, device_recount& dev) REQUIRES(p.mu) {
  const int k = static_cast<int>(s.kind);
  const bool asleep = p.domain != 0 && sleeper.asleep(p.domain);
  if (s.vm != nullptr) {
    std::int64_t mappings = 0;
    check_range(p, s, rc.reserved[k], mappings, asleep, dev.sleeping_pages[p.domain],
                p.pages.straddles(), pg->largest_chunk_pages());
    rc.seg_count[k] += mappings != 0;  // segment_count: ranges holding memory, not mappings
    return;
  }
  if (s.whole_vm && (p.graph == nullptr || p.domain == 0 || !expandable)) {
    violated(
        fmt::format("segment {:#x}: whole-VM, but pool {} is no graph part of a sleep "
                    "domain in expandable mode",
                    s.base, p.index));
  }
  if (s.unmapped && (!s.whole_vm || !asleep)) {
    violated(fmt::format("segment {:#x}: unmapped, but {}", s.base,
                         s.whole_vm ? "its sleep domain is awake" : "not whole-VM"));
  }
  if (s.whole_vm && asleep) dev.sleeping_graph[p.domain] += s.size;
  if (!s.unmapped) {
    rc.reserved[k] += static_cast<std::int64_t>(s.size);
    rc.seg_count[k] += 1;
  }
}

/// Segment s's blocks tile it in address order, linked both ways, in multiples of 512 B; no two
/// free blocks are adjacent; a free block is in its free index, an allocated one in its pool's
/// block map with a requested size within its own, a pending one waits on an event. Counted into
/// rc.
void check_blocks(const detail::stream_pool& p, const segment& s, const detail::block_map& blocks,
                  pool_recount& rc, device_recount& dev) REQUIRES(p.mu) {
  const int k = static_cast<int>(s.kind);
  std::uintptr_t cursor = s.base;
  const block* prev = nullptr;
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (b->prev != prev) violated(fmt::format("block {:#x}: prev link broken", b->addr));
    if (b->seg != &s) violated(fmt::format("block {:#x}: wrong segment", b->addr));
    if (b->addr != cursor) {
      violated(fmt::format("segment {:#x}: gap or overlap at {:#x} (block at {:#x})", s.base,
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
        ++rc.free_count[k];
        rc.free_bytes[k] += b->size;
        break;
      case block_state::allocated:
        if (blocks.find(b->addr) != b) {
          violated(fmt::format("allocated block {:#x} is not in its pool's block map", b->addr));
        }
        if (b->requested == 0 || b->requested > b->size) {
          violated(
              fmt::format("block {:#x}: requested {} vs size {}", b->addr, b->requested, b->size));
        }
        ++dev.allocated_blocks;
        rc.alloc_bytes[k] += static_cast<std::int64_t>(b->size);
        rc.alloc_count[k] += 1;
        rc.requested[k] += static_cast<std::int64_t>(b->requested);
        rc.active_bytes[k] += static_cast<std::int64_t>(b->size);
        rc.active_count[k] += 1;
        break;
      case block_state::pending:
        if (b->uses == nullptr || b->uses->pending_events == 0) {
          violated(fmt::format("pending block {:#x} waits on no event", b->addr));
        }
        rc.pending_events += b->uses->pending_events;
        rc.active_bytes[k] += static_cast<std::int64_t>(b->size);
        rc.active_count[k] += 1;
        break;
    }
    cursor += b->size;
    prev = b;
  }
  if (cursor != s.base + s.size) {
    violated(
        fmt::format("segment {:#x}: blocks cover {} of {} bytes", s.base, cursor - s.base, s.size));
  }
}

/// p's free indices hold exactly the free blocks counted, each bin in strict (size, address)
/// order (best fit relies on it, and splits and merges re-link blocks in place); p's statistics
/// equal the recount, kind by kind.
void check_index_and_stats(const detail::stream_pool& p, const pool_recount& rc) REQUIRES(p.mu) {
  for (int k = 0; k < 2; ++k) {
    if (!p.free[k].well_formed()) {
      violated(fmt::format("pool {} {}: free index malformed (free_index::well_formed)", p.index,
                           k == 0 ? "small" : "large"));
    }
    const block* last = nullptr;
    p.free[k].for_each([&](const block* b) {
      if (b->bin != detail::free_index::bin_of(b->size)) {
        violated(
            fmt::format("free block {:#x} of {} bytes is in bin {}", b->addr, b->size, b->bin));
      }
      if (last != nullptr && last->bin == b->bin &&
          !(last->size < b->size || (last->size == b->size && last->addr < b->addr))) {
        violated(
            fmt::format("bin {}: block {:#x} is listed before {:#x}", b->bin, last->addr, b->addr));
      }
      last = b;
    });
    if (const detail::free_index::totals_t t = p.free[k].totals();
        t.count != rc.free_count[k] || t.bytes != rc.free_bytes[k]) {
      violated(fmt::format("pool {} {}: free index holds {} blocks / {} bytes, segments {} / {}",
                           p.index, k == 0 ? "small" : "large", t.count, t.bytes,
                           rc.free_count[k], rc.free_bytes[k]));
    }
    const std::size_t slot = k == 0 ? 1 : 2;
    auto check = [&](const char* name, std::int64_t current, std::int64_t expect) {
      if (current != expect) {
        violated(fmt::format("pool {} {} {}: stat says {}, recount {}", p.index,
                             k == 0 ? "small" : "large", name, current, expect));
      }
    };
    const auto& st = p.stats;
    check("allocated_bytes", st.allocated_bytes[slot].current, rc.alloc_bytes[k]);
    check("allocation_count", st.allocation_count[slot].current, rc.alloc_count[k]);
    check("active_bytes", st.active_bytes(slot).current, rc.active_bytes[k]);
    check("active_count", st.active_count(slot).current, rc.active_count[k]);
    check("reserved_bytes", st.reserved_bytes[slot].current, rc.reserved[k]);
    check("segment_count", st.segment_count[slot].current, rc.seg_count[k]);
    check("requested_bytes", st.requested_bytes[slot].current, rc.requested[k]);
  }
}

}  // namespace

// The composition: every pool walked under its lock (its pages by the pager, its segments' memory,
// blocks, pending queues, free indices, statistics and oversize counts here), then each part's
// own check against the sums the walk counted.
void device_allocator::check_invariants() const {
  const impl& m = *impl_;
  // Marks nothing stale: a missed mark shows in the ledger's check.
  detail::pool_table::all_locked all(m.pools, detail::pool_table::purpose::read);
  device_recount dev;
  for (const auto& pp : m.pools) {
    const detail::stream_pool& p = *pp;
    detail::pool_table::assert_locked(p);
    if (m.pager) m.pager->check_invariants(p);  // the pool's range list and idle list
    dev.address_bytes +=
        p.pages.range_bytes(pool_kind::small) + p.pages.range_bytes(pool_kind::large);
    pool_recount rc;
    const std::size_t allocated_before = dev.allocated_blocks;
    const segment* prev_seg = nullptr;
    for (const segment* s = p.segments; s != nullptr; s = s->next) {
      if (s->prev != prev_seg) violated(fmt::format("segment {:#x}: broken segment list", s->base));
      prev_seg = s;
      if (s->owner != &p) violated(fmt::format("segment {:#x}: wrong owner", s->base));
      if (m.directory.owner_of(s->base) != &p ||
          m.directory.owner_of(s->base + s->size - 1) != &p) {
        violated(fmt::format("segment {:#x} of pool {}: the segment directory names another owner",
                             s->base, p.index));
      }
      ++dev.segments;
      check_segment_memory(p, *s, m.sleeper, m.pager.get(), m.cfg.expandable_segments, rc, dev);
      check_blocks(p, *s, p.blocks, rc, dev);
    }
    if (p.blocks.size() != dev.allocated_blocks - allocated_before) {
      violated(fmt::format("pool {}: its block map holds {} blocks, {} are allocated", p.index,
                           p.blocks.size(), dev.allocated_blocks - allocated_before));
    }
    if (rc.pending_events != p.pending.size() + p.retained) {
      violated(
          fmt::format("pool {}: {} pending events recorded and {} retentions, blocks wait "
                      "on {}",
                      p.index, p.pending.size(), p.retained, rc.pending_events));
    }
    check_pending_queues(p);
    check_index_and_stats(p, rc);
    // The oversize counts follow the rules in force (set_size_rules recounts them).
    if (const auto [os_segments, os_allocations] = m.recount_oversize(p);
        p.stats.oversize_segments != os_segments ||
        p.stats.oversize_allocations != os_allocations) {
      violated(
          fmt::format("pool {}: oversize segments / allocations: stats say {} / {}, recount "
                      "{} / {} (max_split_size {})",
                      p.index, p.stats.oversize_segments, p.stats.oversize_allocations, os_segments,
                      os_allocations, m.policy.max_split_size()));
    }
    dev.reserved += static_cast<std::size_t>(rc.reserved[0] + rc.reserved[1]);
  }
  if (m.directory.segments() != dev.segments) {
    violated(fmt::format("the segment directory holds {} segments, the pools {}",
                         m.directory.segments(), dev.segments));
  }
  // Each part's own check, against what the walk counted.
  m.sleeper.check_invariants(dev.sleeping_pages, dev.sleeping_graph, m.page_bytes);
  m.graphs.check_invariants();
  if (const std::string why = m.pools.check_map(); !why.empty()) violated(why);
  std::size_t handle_bytes = 0;
  if (m.pager) handle_bytes = m.pager->check_device_wide(dev.address_bytes);
  m.budget.check_invariants(dev.reserved + handle_bytes);
  m.ledger.check(m.ledger_parts());
}

}  // namespace cucache
