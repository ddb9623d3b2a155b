// Which pool owns an address (see src/core/segment_directory.hpp).
#include "core/segment_directory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <new>
#include <stdexcept>

#include <fmt/format.h>

namespace cucache::detail {
namespace {

constexpr std::size_t k_top_bytes =
    (std::size_t{1} << segment_directory::k_top_bits) * sizeof(std::uintptr_t);
constexpr std::uintptr_t k_granule = std::uintptr_t{1} << segment_directory::k_granule_log2;
constexpr std::uintptr_t k_gib = std::uintptr_t{1} << segment_directory::k_top_log2;  // a top entry
constexpr std::uintptr_t k_limit = std::uintptr_t{1} << segment_directory::k_address_bits;

}  // namespace

segment_directory::segment_directory() {
  // An anonymous mapping: zero, and committed only where written (a page or two per device).
  void* p = mmap(nullptr, k_top_bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  top_ = static_cast<std::uintptr_t*>(p);
}

segment_directory::~segment_directory() {
  lock_guard lk(mu_);  // (nobody else any more: for the analysis)
  for (std::uintptr_t* n : nodes_) std::free(n);
  munmap(top_, k_top_bytes);
}

void segment_directory::add(std::uintptr_t base, std::size_t bytes, stream_pool* owner) {
  const auto o = reinterpret_cast<std::uintptr_t>(owner);
  if (bytes == 0 || base + bytes < base || owner == nullptr || (o & (k_shared | k_node)) != 0) {
    throw std::invalid_argument(fmt::format(
        "segment_directory::add: segment {:#x} of {} bytes (owner {}) is empty, wraps around the "
        "address space, or has no owner or one that is not 4-byte aligned",
        base, bytes, fmt::ptr(owner)));
  }
  const std::uintptr_t end = base + bytes;
  lock_guard lk(mu_);
  // Overlap: the segment before base must end by base, the one at or after base start at end.
  auto next = index_.lower_bound(base);
  auto hit = index_.end();
  if (next != index_.end() && next->first < end) {
    hit = next;
  } else if (next != index_.begin() && std::prev(next)->second.end > base) {
    hit = std::prev(next);
  }
  if (hit != index_.end()) {
    throw std::invalid_argument(fmt::format(
        "segment_directory::add: segment {:#x} of {} bytes overlaps the live segment {:#x} of {} "
        "bytes: the backend handed out memory it had handed out before and not taken back",
        base, bytes, hit->first, hit->second.end - hit->first));
  }
  // Storage first (the nodes, the index's node): a failure leaves every answer as it was.
  make_nodes(base, end);
  index_.emplace_hint(next, base, span{end, owner});
  fill(base, end, o);
}

void segment_directory::remove(std::uintptr_t base) noexcept {
  static_cast<void>(take_out(base));
}

segment_directory::taken_segment segment_directory::take_out(std::uintptr_t base) noexcept {
  lock_guard lk(mu_);
  taken_segment t;
  t.node_ = index_.extract(base);
  if (!t.node_.empty()) fill(base, t.node_.mapped().end, 0);
  return t;
}

void segment_directory::put_back(taken_segment&& t) noexcept {
  if (t.node_.empty()) return;
  lock_guard lk(mu_);
  const std::uintptr_t base = t.node_.key();
  const span sp = t.node_.mapped();
  index_.insert(std::move(t.node_));
  fill(base, sp.end, reinterpret_cast<std::uintptr_t>(sp.owner));
}

void segment_directory::make_nodes(std::uintptr_t base, std::uintptr_t end) {
  // Only the GiB that holds base and the one that holds end - 1 can be covered in part.
  for (const std::uintptr_t edge : {base, end - 1}) {
    if (edge >= k_limit) continue;
    const std::uintptr_t r = edge >> k_top_log2 << k_top_log2;
    if (base <= r && r + k_gib <= end) continue;  // covered whole: an owner entry, no node
    std::uintptr_t& e = top_[edge >> k_top_log2];
    if ((e & k_node) != 0) continue;
    // Covered in part, so no live segment covers all of it: e is 0, and a zeroed node answers
    // 0 too.
    nodes_.reserve(nodes_.size() + 1);
    void* n = std::calloc(k_node_mask + 1, sizeof(std::uintptr_t));
    if (n == nullptr) throw std::bad_alloc();
    nodes_.push_back(static_cast<std::uintptr_t*>(n));  // (reserved: no throw)
    store(e, reinterpret_cast<std::uintptr_t>(n) | k_node);
  }
}

void segment_directory::fill(std::uintptr_t base, std::uintptr_t end,
                             std::uintptr_t whole) noexcept {
  const std::uintptr_t to = std::min(end, k_limit);
  for (std::uintptr_t r = base >> k_top_log2 << k_top_log2; r < to; r += k_gib) {
    std::uintptr_t& e = top_[r >> k_top_log2];
    if ((e & k_node) != 0) {
      fill_node(node(e), r, base, end, whole);
    } else if (base <= r && r + k_gib <= end) {
      store(e, whole);
    }
    // (A GiB covered in part has a node: make_nodes made it.)
  }
}

void segment_directory::fill_node(std::uintptr_t* granules, std::uintptr_t lo, std::uintptr_t base,
                                  std::uintptr_t end, std::uintptr_t whole) noexcept {
  const std::uintptr_t from = std::max(base, lo);
  const std::uintptr_t to = std::min(end, lo + k_gib);
  std::uintptr_t i = (from - lo) >> k_granule_log2;          // the first granule it meets
  std::uintptr_t n = ((to - 1 - lo) >> k_granule_log2) + 1;  // one past the last
  // The first and the last may be covered in part (their entry follows from every segment in
  // them); those between are the segment's.
  if (lo + (i << k_granule_log2) < base) {
    store(granules[i], granule_entry(lo + (i << k_granule_log2)));
    ++i;
  }
  if (i < n && end < lo + (n << k_granule_log2)) {
    --n;
    store(granules[n], granule_entry(lo + (n << k_granule_log2)));
  }
  for (; i < n; ++i) store(granules[i], whole);
}

std::uintptr_t segment_directory::granule_entry(std::uintptr_t lo) const noexcept {
  const std::uintptr_t hi = lo + k_granule;
  // The segments that meet [lo, hi): the one that starts before lo (if it reaches past lo), then
  // those that start inside.
  auto it = index_.lower_bound(lo);
  if (it != index_.begin() && std::prev(it)->second.end > lo) --it;
  std::uintptr_t e = 0;
  for (; it != index_.end() && it->first < hi; ++it) {
    const auto o = reinterpret_cast<std::uintptr_t>(it->second.owner);
    if (e == 0) {
      e = o;
    } else if (e != o) {
      return k_shared;
    }
  }
  return e;
}

stream_pool* segment_directory::owner_by_index(std::uintptr_t addr) const noexcept {
  shared_lock lk(mu_);
  auto it = index_.upper_bound(addr);
  if (it == index_.begin()) return nullptr;
  --it;
  return addr < it->second.end ? it->second.owner : nullptr;
}

std::size_t segment_directory::segments() const {
  shared_lock lk(mu_);
  return index_.size();
}

std::size_t segment_directory::nodes() const {
  shared_lock lk(mu_);
  return nodes_.size();
}

bool segment_directory::shared_granule(std::uintptr_t addr) const noexcept {
  return (addr >> k_address_bits) != 0 || entry(addr) == k_shared;
}

}  // namespace cucache::detail
