// Graph pools as PyTorch's private pools beyond routes and release: owners added without a route
// (createOrIncrefPool), the live allocations of a pool (checkPoolLiveAllocations), one pool's
// cache given back (emptyCache(mempool_id)), and checkpoints of a pool's layout that cudagraph
// trees go back to (getCheckpointState / setCheckpointPoolState). docs/design.md, "Graph
// capture" and "Checkpoints".
#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "allocator/allocator_impl.hpp"
#include "cucache/errors.hpp"

using cucache::detail::block;
using cucache::detail::block_state;
using cucache::detail::segment;
using cucache::detail::stream_pool;

namespace cucache {
namespace {

std::string pool_name(graph_pool_id gid) {
  return fmt::format("graph pool ({:#x}, {:#x})", gid.first, gid.second);
}

/// Whether any block of p waits for other streams' work (pending) or is held for a graph.
bool has_waiting_blocks(const stream_pool& p) REQUIRES(p.mu) {
  if (!p.pending.empty() || p.retained != 0) return true;
  for (const segment* s = p.segments; s != nullptr; s = s->next) {
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->state == block_state::pending) return true;
    }
  }
  return false;
}

}  // namespace

void device_allocator::create_or_incref_graph_pool(graph_pool_id pool) {
  detail::pool_table::all_locked all(impl_->pools);
  impl_->graphs.incref(pool);
}

void device_allocator::set_graph_pool_no_split(graph_pool_id pool) {
  detail::pool_table::all_locked all(impl_->pools);
  impl_->graphs.set_no_split(pool);
}

std::vector<void*> device_allocator::graph_pool_live_allocations(graph_pool_id pool) const {
  detail::pool_table::all_locked all(impl_->pools, detail::pool_table::purpose::read);
  std::vector<void*> out;
  for (const stream_pool* part : impl_->graphs.parts_of(pool).parts) {
    detail::pool_table::assert_locked(*part);
    for (const segment* s = part->segments; s != nullptr; s = s->next) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::allocated) out.push_back(reinterpret_cast<void*>(b->addr));
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void device_allocator::empty_graph_pool_cache(graph_pool_id pool) {
  impl& m = *impl_;
  detail::pool_table::all_locked all(m.pools);
  const detail::graph_pools::parts_view v = m.graphs.parts_of(pool);
  if (!v.exists) {
    throw invalid_argument(
        fmt::format("cucache::empty_graph_pool_cache: {} does not exist", pool_name(pool)));
  }
  if (m.sync_blocked()) m.graphs.throw_capture_blocks("empty_graph_pool_cache");
  // A replay of a graph of the pool may still run: one synchronization before anything goes.
  m.backend->device_synchronize();
  for (stream_pool* part : v.parts) {
    detail::pool_table::assert_locked(*part);
    if (!part->pending.empty()) m.sync_pending(*part);
    std::vector<segment*> victims;
    for (segment* s = part->segments; s != nullptr; s = s->next) {
      if (s->whole_free()) victims.push_back(s);
    }
    for (segment* s : victims) m.release_segment(*part, s);
  }
}

device_allocator::graph_pool_checkpoint device_allocator::checkpoint_graph_pool(
    graph_pool_id pool) const {
  detail::pool_table::all_locked all(impl_->pools, detail::pool_table::purpose::read);
  const detail::graph_pools::parts_view v = impl_->graphs.parts_of(pool);
  if (!v.exists) {
    throw invalid_argument(
        fmt::format("cucache::checkpoint_graph_pool: {} does not exist", pool_name(pool)));
  }
  graph_pool_checkpoint cp;
  cp.pool = pool;
  for (const stream_pool* part : v.parts) {
    detail::pool_table::assert_locked(*part);
    if (has_waiting_blocks(*part)) {
      throw invalid_argument(fmt::format(
          "cucache::checkpoint_graph_pool: {} holds blocks freed but waiting for other streams' "
          "work (record_stream); a checkpoint needs every block either live or free",
          pool_name(pool)));
    }
    for (const segment* s = part->segments; s != nullptr; s = s->next) {
      cp.segments.push_back({s->base, s->size, part->stream});
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::allocated) {
          cp.live.push_back({b->addr, b->size, b->requested, part->stream});
        }
      }
    }
  }
  const auto by_address = [](const auto& a, const auto& b) { return a.address < b.address; };
  std::sort(cp.segments.begin(), cp.segments.end(), by_address);
  std::sort(cp.live.begin(), cp.live.end(), by_address);
  return cp;
}

device_allocator::graph_pool_restored device_allocator::restore_graph_pool(
    const graph_pool_checkpoint& cp) {
  impl& m = *impl_;
  graph_pool_restored out;
  std::vector<std::pair<graph_pool_checkpoint::block, bool>> told;  // (block, freed) for observers
  {
    detail::pool_table::all_locked all(m.pools);
    const detail::graph_pools::parts_view v = m.graphs.parts_of(cp.pool);
    const auto refuse = [&](const std::string& why) {
      throw invalid_argument(
          fmt::format("cucache::restore_graph_pool: {} {}", pool_name(cp.pool), why));
    };
    if (!v.exists) refuse("does not exist");
    if (v.released) refuse("was released (no owner left): its layout is gone");
    // Every check before any change: the segments of the checkpoint are still the pool's, its
    // live blocks lie inside them without overlapping, no block of the pool waits.
    std::map<std::uintptr_t, std::pair<stream_pool*, segment*>> segs;
    for (stream_pool* part : v.parts) {
      detail::pool_table::assert_locked(*part);
      if (has_waiting_blocks(*part)) {
        refuse("holds blocks freed but waiting for other streams' work (record_stream)");
      }
      for (segment* s = part->segments; s != nullptr; s = s->next) {
        segs.emplace(s->base, std::pair{part, s});
      }
    }
    for (const auto& cs : cp.segments) {
      auto it = segs.find(cs.address);
      if (it == segs.end() || it->second.second->size != cs.size) {
        refuse(fmt::format("no longer has the segment at {:#x} ({} bytes) of the checkpoint",
                           cs.address, cs.size));
      }
    }
    std::vector<std::pair<stream_pool*, segment*>> home(cp.live.size());
    std::uintptr_t end_of_last = 0;
    for (std::size_t i = 0; i < cp.live.size(); ++i) {
      const auto& lb = cp.live[i];
      auto it = segs.upper_bound(lb.address);
      if (lb.size == 0 || it == segs.begin() || lb.address < end_of_last) {
        refuse(fmt::format("checkpoint block at {:#x} ({} bytes) is empty, overlaps another or "
                           "lies before every segment",
                           lb.address, lb.size));
      }
      --it;
      const segment* s = it->second.second;
      if (lb.address + lb.size > s->base + s->size) {
        refuse(fmt::format("checkpoint block at {:#x} ({} bytes) does not lie inside a segment",
                           lb.address, lb.size));
      }
      home[i] = it->second;
      end_of_last = lb.address + lb.size;
    }
    // Free every live allocation of the pool at once.
    for (stream_pool* part : v.parts) {
      detail::pool_table::assert_locked(*part);
      std::vector<block*> live;
      for (segment* s = part->segments; s != nullptr; s = s->next) {
        for (block* b = s->first; b != nullptr; b = b->next) {
          if (b->state == block_state::allocated) live.push_back(b);
        }
      }
      for (block* b : live) {
        static_cast<void>(part->blocks.take(b->addr));
        out.freed.push_back(reinterpret_cast<void*>(b->addr));
        told.push_back({{b->addr, b->size, b->requested, part->stream}, true});
        part->stats.on_free(b->seg->kind, static_cast<std::int64_t>(b->size),
                            static_cast<std::int64_t>(b->requested));
        if (m.policy.is_oversize(b->size)) --part->stats.oversize_allocations;
        b->requested = 0;
        m.release_to_free(*part, b);
      }
    }
    // Allocate the checkpoint's live blocks again, each carved at its address from the free
    // block now covering it (every block of the pool is free).
    for (std::size_t i = 0; i < cp.live.size(); ++i) {
      const auto& lb = cp.live[i];
      auto [part, s] = home[i];
      detail::pool_table::assert_locked(*part);
      block* b = s->first;
      while (b != nullptr && lb.address >= b->addr + b->size) b = b->next;
      auto& index = part->index_of(s->kind);
      index.erase(b);
      if (lb.address > b->addr) {
        block* rest = m.split_off_outline(*part, b, lb.address - b->addr);
        b->size = lb.address - b->addr;
        index.insert(b);
        b = rest;
      }
      if (b->size > lb.size) {
        block* tail = m.split_off_outline(*part, b, lb.size);
        b->size = lb.size;
        index.insert(tail);
      }
      b->state = block_state::allocated;
      b->requested = lb.requested;
      b->uses = nullptr;
      part->stats.on_allocate(s->kind, static_cast<std::int64_t>(b->size),
                              static_cast<std::int64_t>(b->requested));
      if (m.policy.is_oversize(b->size)) ++part->stats.oversize_allocations;
      part->blocks.insert(b->addr, b);
      out.allocated.push_back({b->addr, b->size, b->requested, part->stream});
      told.push_back({out.allocated.back(), false});
    }
  }
  // Observers hear of it outside every lock, frees first (their addresses are reused).
  if (allocation_observer* o = m.observer.load(std::memory_order_acquire)) {
    for (const auto& [b, freed] : told) {
      if (freed) o->on_free(reinterpret_cast<void*>(b.address), b.requested, b.stream);
    }
    for (const auto& [b, freed] : told) {
      if (!freed) o->on_allocate(reinterpret_cast<void*>(b.address), b.requested, b.stream);
    }
  }
  return out;
}

}  // namespace cucache
