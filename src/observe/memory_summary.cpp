// memory_summary(): the statistics as a fixed-width text table in the layout PyTorch users know
// (rows of stats, columns current / peak / total allocated / total freed, each split into all,
// large pool and small pool), followed by cucache's own lines: fragmentation and device calls.
#include <fmt/format.h>

#include <string>
#include <string_view>

#include "core/format_bytes.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache {
namespace {

// Every row is k_width characters, as the stat rows are: "| " + 21 + "| " + 13 + " | " + 13 +
// " | " + 12 + " | " + 12 + " |".
constexpr int k_width = detail::k_summary_width;

void rule(std::string& out, char c) {
  out.append("|");
  out.append(k_width - 2, c);
  out.append("|\n");
}

// A row of free text; text longer than the row is wrapped at spaces onto rows indented by two.
void line(std::string& out, std::string_view text) {
  constexpr std::size_t room = k_width - 4;  // "| " + text + " |"
  std::string_view indent;
  while (true) {
    const std::size_t fits = room - indent.size();
    if (text.size() <= fits) {
      out += fmt::format("| {}{:<{}} |\n", indent, text, fits);
      return;
    }
    std::size_t cut = text.rfind(' ', fits);
    if (cut == std::string_view::npos || cut == 0) cut = fits;  // one word longer than a row
    out += fmt::format("| {}{:<{}} |\n", indent, text.substr(0, cut), fits);
    text.remove_prefix(cut);
    while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
    indent = "  ";
  }
}

void stat_rows(std::string& out, std::string_view title, const stat_array& s, bool bytes) {
  auto cell = [&](std::int64_t v) {
    return bytes ? detail::format_bytes(static_cast<double>(v)) : fmt::format("{}", v);
  };
  const char* names[] = {"from all pools", "  from large pool", "  from small pool"};
  const std::size_t order[] = {0, 2, 1};
  line(out, title);
  for (int i = 0; i < 3; ++i) {
    const stat& st = s[order[i]];
    out += fmt::format("| {:<21}| {:>13} | {:>13} | {:>12} | {:>12} |\n", names[i],
                       cell(st.current), cell(st.peak), cell(st.allocated), cell(st.freed));
  }
  rule(out, '-');
}

}  // namespace

std::string device_allocator::memory_summary() const {
  const device_stats s = stats();
  std::string out;
  rule(out, '=');
  line(out, fmt::format("cucache memory summary, device {} ({})", device(), backend().name()));
  rule(out, '-');
  line(out,
       fmt::format("device allocs: {:<8} device frees: {:<8} OOMs: {:<6} retries: {}",
                   s.device_alloc_count, s.device_free_count, s.oom_count, s.alloc_retry_count));
  rule(out, '=');
  out += fmt::format("| {:<21}| {:>13} | {:>13} | {:>12} | {:>12} |\n", "Metric", "Cur Usage",
                     "Peak Usage", "Tot Alloc", "Tot Freed");
  rule(out, '-');
  stat_rows(out, "Allocated memory", s.allocated_bytes, true);
  stat_rows(out, "Active memory", s.active_bytes, true);
  stat_rows(out, "Requested memory", s.requested_bytes, true);
  stat_rows(out, "Reserved memory", s.reserved_bytes, true);
  stat_rows(out, "Non-releasable memory (current only)", s.inactive_split_bytes, true);
  stat_rows(out, "Allocations", s.allocation_count, false);
  stat_rows(out, "Active allocs", s.active_count, false);
  stat_rows(out, "Segments", s.segment_count, false);
  stat_rows(out, "Non-releasable allocs (current only)", s.inactive_split_count, false);
  // The largest request the cache serves without new device memory (docs/design.md).
  // Two rows each, broken where a reader expects (line() would wrap them anywhere).
  line(out, fmt::format("Free (cached) memory: {} in {} pieces,",
                        detail::format_bytes(static_cast<double>(s.free_bytes)), s.free_block_count));
  line(out, fmt::format("  largest servable request {}",
                        detail::format_bytes(static_cast<double>(s.largest_free_block))));
  line(out, fmt::format("Fragmentation: external {:.1f}% (1 - largest servable / free),",
                        100.0 * s.external_fragmentation()));
  line(out, fmt::format("  overhead {:.1f}% (unused share of reserved)",
                        100.0 * s.overhead_fragmentation()));
  line(out, fmt::format("Oversize allocations: {}   oversize segments: {}   pending frees: {}",
                        s.oversize_allocations, s.oversize_segments, s.events_pending));
  if (get_config().expandable_segments) {
    // Device allocs and frees above are its cuMemCreate and cuMemRelease calls.
    line(out, fmt::format("Expandable: {} mapped, {} in unmapped handles; VM calls: {} map, "
                          "{} unmap; {} pages stitched ({} from other streams); {} device syncs; "
                          "{} idle mappings split; {} reclaims",
                          detail::format_bytes(static_cast<double>(s.mapped_bytes)),
                          detail::format_bytes(static_cast<double>(s.unmapped_handle_bytes)),
                          s.vm_map_count, s.vm_unmap_count, s.stitched_pages, s.shared_pages,
                          s.vm_sync_count, s.vm_split_count, s.vm_reclaim_count));
    line(out, fmt::format("Pager host time: {:.3f} ms in VM calls, {:.3f} ms in {} device syncs",
                          static_cast<double>(s.vm_host_ns) / 1e6,
                          static_cast<double>(s.sync_host_ns) / 1e6, s.vm_sync_count));
  }
  if (s.sleeping_bytes != 0 || s.sleeping_host_bytes != 0) {
    line(out, fmt::format("Sleeping: {} released by sleeping tags, {} of their contents in "
                          "pinned host memory",
                          detail::format_bytes(static_cast<double>(s.sleeping_bytes)),
                          detail::format_bytes(static_cast<double>(s.sleeping_host_bytes))));
  }
  line(out,
       fmt::format("Memory limit: {}   device capacity: {}",
                   s.memory_limit == 0 ? std::string("none")
                                       : detail::format_bytes(static_cast<double>(s.memory_limit)),
                   detail::format_bytes(static_cast<double>(s.device_total_bytes))));
  rule(out, '=');
  return out;
}

}  // namespace cucache
