// The errors a caller sees when the allocator cannot help: the out-of-memory report, and the
// diagnosis of a pointer that is not a live allocation.
#include <fmt/format.h>

#include "allocator/allocator_impl.hpp"
#include "core/format_bytes.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::format_bytes;

void device_allocator::impl::throw_oom(std::size_t bytes, std::size_t rounded,
                                       stream_handle stream, oom_cause cause) {
  budget.oom_count.fetch_add(1, std::memory_order_relaxed);
  device_stats s;
  {
    detail::lock_guard reader(ledger.readers);
    detail::pool_table::all_locked all(pools);
    s = ledger.read_locked(ledger_parts());
  }
  std::string device_free = "unknown";
  try {
    device_free = format_bytes(static_cast<double>(backend->mem_get_info().free_bytes));
  } catch (...) {
  }
  const auto held = static_cast<double>(s.reserved_bytes[0].current);
  const auto allocated = static_cast<double>(s.allocated_bytes[0].current);
  std::string msg = fmt::format(
      "cucache: out of memory on device {} ({}): tried to allocate {} ({} bytes{}) on stream {}. "
      "Device capacity {}, of which {} is free. cucache holds {} reserved: {} allocated, {} "
      "reserved but unallocated in {} free blocks (largest {}). Fragmentation: external {:.1f}%, "
      "overhead {:.1f}%.",
      backend->device(), backend->name(), format_bytes(static_cast<double>(bytes)), bytes,
      rounded == 0 ? std::string(", beyond any device") : fmt::format(", rounded to {}", rounded),
      fmt::ptr(stream), format_bytes(static_cast<double>(budget.device_total)), device_free,
      format_bytes(held), format_bytes(allocated), format_bytes(held - allocated),
      s.free_block_count, format_bytes(static_cast<double>(s.largest_free_block)),
      100.0 * s.external_fragmentation(), 100.0 * s.overhead_fragmentation());
  if (const std::size_t limit = budget.limit.load(std::memory_order_relaxed); limit != 0) {
    msg += fmt::format(" The memory limit is {}.", format_bytes(static_cast<double>(limit)));
  }
  if (cause == oom_cause::address_space) {
    msg += fmt::format(
        " The process's virtual address space has no room for a new range of expandable "
        "segments (cuMemAddressReserve refused it; cucache's ranges on this device span {}): "
        "fewer streams holding cached memory at once, or empty_cache, give address space back.",
        format_bytes(static_cast<double>(pager->reserved_address_bytes())));
  }
  if (sync_blocked()) {
    msg +=
        " A CUDA graph capture is underway: cached memory cannot be given back to the device "
        "meanwhile (cudaFree and unmapping synchronize the device, which is illegal during a "
        "capture).";
  }
  if (s.external_fragmentation() > 0.5 && held - allocated > static_cast<double>(bytes)) {
    msg += " Much reserved memory is free but fragmented: expandable_segments:True avoids this.";
  }
  throw out_of_memory(std::move(msg));
}

std::string device_allocator::impl::explain_bad_pointer(const void* ptr, const char* what) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::string why = "it was not allocated by cucache on this device";
  {
    detail::pool_table::all_locked all(pools);
    for (const auto& p : pools) {
      detail::pool_table::assert_locked(*p);
      for (const detail::segment* s = p->segments; s != nullptr; s = s->next) {
        if (addr < s->base || addr >= s->base + s->size) continue;
        for (const detail::block* b = s->first; b != nullptr; b = b->next) {
          if (addr < b->addr || addr >= b->addr + b->size) continue;
          if (b->addr == addr) {
            why = "it was already freed";
          } else if (b->state == detail::block_state::allocated) {
            why = fmt::format(
                "it points {} bytes into the live allocation at {:#x}: pass the "
                "allocation's start",
                addr - b->addr, b->addr);
          } else {
            why = fmt::format(
                "it points into free memory (inside the block at {:#x}, already "
                "freed)",
                b->addr);
          }
        }
      }
    }
  }
  return fmt::format("cucache: {}({}) on device {}: {}", what, ptr, backend->device(), why);
}

void device_allocator::impl::throw_bad_pointer(const void* ptr, const char* what) {
  throw invalid_argument(explain_bad_pointer(ptr, what));
}

device_allocator::address_info device_allocator::locate(const void* ptr) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  address_info info;
  detail::pool_table::all_locked all(impl_->pools, detail::pool_table::purpose::read);
  for (const auto& p : impl_->pools) {
    detail::pool_table::assert_locked(*p);
    for (const detail::segment* s = p->segments; s != nullptr; s = s->next) {
      if (addr < s->base || addr >= s->base + s->size) continue;
      info.in_segment = true;
      info.segment = s->base;
      info.segment_size = s->size;
      for (const detail::block* b = s->first; b != nullptr; b = b->next) {
        if (addr < b->addr || addr >= b->addr + b->size) continue;
        info.block = b->addr;
        info.block_size = b->size;
        info.live = b->state == detail::block_state::allocated;
        return info;
      }
      return info;
    }
  }
  return info;
}

std::string device_allocator::explain_bad_pointer(const void* ptr, const char* what) const {
  return impl_->explain_bad_pointer(ptr, what);
}

}  // namespace cucache
