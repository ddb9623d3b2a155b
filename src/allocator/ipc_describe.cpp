// device_allocator::ipc_describe: where a live block lies, for sharing it with another process
// (docs/design.md, "IPC"). Read-only: it walks the segments and, for an expandable segment, the
// page table under every pool lock, and changes nothing. note_ipc_export marks an exported
// block, which keeps its sleep domain from sleeping while it lives (tag_sleeper.cpp).
#include <fmt/format.h>

#include <cstdint>
#include <optional>

#include "allocator/allocator_impl.hpp"
#include "core/vm_range.hpp"
#include "cucache/errors.hpp"

namespace cucache {

std::optional<device_allocator::ipc_block> device_allocator::ipc_describe(const void* ptr) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  detail::pool_table::all_locked all(impl_->pools);
  for (const auto& p : impl_->pools) {
    detail::pool_table::assert_locked(*p);
    for (const detail::segment* s = p->segments; s != nullptr; s = s->next) {
      if (addr < s->base || addr >= s->base + s->size) continue;
      const detail::block* b = s->first;
      while (b != nullptr && !(addr >= b->addr && addr < b->addr + b->size)) b = b->next;
      if (b == nullptr || b->addr != addr || b->state != detail::block_state::allocated) {
        return std::nullopt;
      }
      // A sleeping domain's block has no physical memory to export: say so (invalid_argument).
      detail::pool_table::assert_locked(*p);
      impl_->sleeper.refuse_if_asleep(*p, ptr, "ipc_get_handle");
      ipc_block out;
      out.size = b->size;
      if (s->vm == nullptr) {
        out.base = s->base;
        out.span = s->size;
        out.offset = addr - s->base;
        return out;
      }
      // Expandable: every page of a live block is mapped, by a handle of its own or a chunk's
      // (one piece per mapping; a straddled chunk may begin before the block's first page).
      const detail::vm_range& r = *s->vm;
      out.expandable = true;
      const std::size_t first = r.mapping_of(r.page_of(addr)).first;
      const std::size_t last = r.page_of(addr + b->size - 1);
      out.base = r.page_addr(first);
      for (std::size_t pg = first; pg <= last;) {
        const detail::vm_page e = r.pages.get(pg);
        if (!e.mapped) return std::nullopt;  // not reachable for a live block
        const std::size_t bytes = r.mapping_of(pg).pages() * r.page_bytes;
        out.pieces.push_back({e.handle, bytes});
        out.span += bytes;
        pg = r.mapping_of(pg).end;
      }
      out.offset = addr - out.base;
      return out;
    }
  }
  return std::nullopt;
}

void device_allocator::note_ipc_export(const void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  detail::pool_table::all_locked all(impl_->pools);
  for (const auto& p : impl_->pools) {
    detail::pool_table::assert_locked(*p);
    for (detail::segment* s = p->segments; s != nullptr; s = s->next) {
      if (addr < s->base || addr >= s->base + s->size) continue;
      detail::block* b = s->first;
      while (b != nullptr && b->addr + b->size <= addr) b = b->next;
      if (b == nullptr || b->addr != addr || b->state != detail::block_state::allocated) break;
      // A sleep between ipc_describe and here released the exported handles: refused.
      detail::pool_table::assert_locked(*p);
      impl_->sleeper.refuse_if_asleep(*p, ptr, "ipc_get_handle");
      b->exported = true;
      return;
    }
  }
  throw invalid_argument(fmt::format(
      "cucache: ipc_get_handle({}) on device {}: the block was freed while its handle was made",
      ptr, device()));
}

}  // namespace cucache
