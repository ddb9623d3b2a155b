// error_report (error_report.hpp): the out-of-memory report, and the pointer walk behind both the
// bad-pointer diagnosis and device_allocator::locate.
#include "allocator/error_report.hpp"

#include <fmt/format.h>

#include "allocator/allocator_impl.hpp"
#include "core/format_bytes.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::format_bytes;

namespace detail {

std::string oom_message(const oom_facts& f) {
  const auto held = static_cast<double>(f.reserved);
  const auto allocated = static_cast<double>(f.allocated);
  std::string msg = fmt::format(
      "cucache: out of memory on device {} ({}): tried to allocate {} ({} bytes{}) on stream {}. "
      "Device capacity {}, of which {} is free. cucache holds {} reserved: {} allocated, {} "
      "reserved but unallocated in {} free blocks (largest {}). Fragmentation: external {:.1f}%, "
      "overhead {:.1f}%.",
      f.device, f.device_name, format_bytes(static_cast<double>(f.bytes)), f.bytes,
      f.rounded == 0 ? std::string(", beyond any device")
                     : fmt::format(", rounded to {}", f.rounded),
      fmt::ptr(f.stream), format_bytes(static_cast<double>(f.device_total)),
      f.device_free ? format_bytes(static_cast<double>(*f.device_free)) : std::string("unknown"),
      format_bytes(held), format_bytes(allocated), format_bytes(held - allocated), f.free_blocks,
      format_bytes(static_cast<double>(f.largest_free_block)), 100.0 * f.external_fragmentation,
      100.0 * f.overhead_fragmentation);
  if (f.limit != 0) {
    msg += fmt::format(" The memory limit is {}.", format_bytes(static_cast<double>(f.limit)));
  }
  if (f.address_space) {
    msg += fmt::format(
        " The process's virtual address space has no room for a new range of expandable "
        "segments (cuMemAddressReserve refused it; cucache's ranges on this device span {}): "
        "fewer streams holding cached memory at once, or empty_cache, give address space back.",
        format_bytes(static_cast<double>(f.address_bytes)));
  }
  if (f.capture_underway) {
    msg +=
        " A CUDA graph capture is underway: cached memory cannot be given back to the device "
        "meanwhile (cudaFree and unmapping synchronize the device, which is illegal during a "
        "capture).";
  }
  if (f.external_fragmentation > 0.5 && held - allocated > static_cast<double>(f.bytes)) {
    msg += " Much reserved memory is free but fragmented: expandable_segments:True avoids this.";
  }
  return msg;
}

device_allocator::address_info locate_pointer(const pool_table& pools, const void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  device_allocator::address_info info;
  pool_table::all_locked all(pools, pool_table::purpose::read);
  for (const auto& p : pools) {
    pool_table::assert_locked(*p);
    for (const segment* s = p->segments; s != nullptr; s = s->next) {
      if (addr < s->base || addr >= s->base + s->size) continue;
      info.in_segment = true;
      info.segment = s->base;
      info.segment_size = s->size;
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (addr < b->addr || addr >= b->addr + b->size) continue;
        info.block = b->addr;
        info.block_size = b->size;
        info.live = b->state == block_state::allocated;
        return info;
      }
      return info;
    }
  }
  return info;
}

std::string explain_pointer(const pool_table& pools, int device, const void* ptr,
                            const char* what) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const device_allocator::address_info at = locate_pointer(pools, ptr);
  std::string why;
  if (at.block == 0) {
    why = "it was not allocated by cucache on this device";
  } else if (at.block == addr) {
    why = "it was already freed";
  } else if (at.live) {
    why = fmt::format(
        "it points {} bytes into the live allocation at {:#x}: pass the "
        "allocation's start",
        addr - at.block, at.block);
  } else {
    why = fmt::format("it points into free memory (inside the block at {:#x}, already freed)",
                      at.block);
  }
  return fmt::format("cucache: {}({}) on device {}: {}", what, ptr, device, why);
}

}  // namespace detail

device_allocator::address_info device_allocator::locate(const void* ptr) const {
  return detail::locate_pointer(impl_->pools, ptr);
}

std::string device_allocator::explain_bad_pointer(const void* ptr, const char* what) const {
  return detail::explain_pointer(impl_->pools, impl_->backend->device(), ptr, what);
}

}  // namespace cucache
