// libFuzzer harness: the trace reader (RMM CSV). Any text either parses or throws
// cucache::invalid_argument naming "<name>:<line>". What parses must summarize without throwing
// (the reader already refused every overflow), with figures that agree with the events, and must
// read back the same events when written out again in the canonical spelling.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "cucache/errors.hpp"
#include "cucache/trace.hpp"
#include "fuzz/fuzz_support.hpp"

namespace {

enum count : std::size_t { inputs, rejected, accepted, rows, roundtrip };
cucache::fuzz::counters<5> g_counts({"inputs", "rejected (invalid_argument)", "accepted",
                                     "rows accepted", "round-trip checked"});

std::string write_back(const std::vector<cucache::trace_event>& events) {
  std::string out(cucache::k_trace_header_tagged);
  out += '\n';
  for (const auto& ev : events) {
    const std::uint64_t us = ev.time_us;
    const std::uint64_t s = us / 1'000'000;
    out += fmt::format("{},{:02}:{:02}:{:02}.{:06},{},", ev.thread, s / 3600, s / 60 % 60, s % 60,
                       us % 1'000'000, cucache::action_text(ev));
    out += ev.pointer == 0 ? std::string("(nil)") : fmt::format("{:#x}", ev.pointer);
    out += fmt::format(",{},{:x}", ev.size, ev.stream);
    if (ev.tag != 0) {
      out += ',';
      cucache::append_trace_tag(out, cucache::trace_tag_name(ev.tag));
    }
    out += '\n';
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_counts.add(inputs);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<cucache::trace_event> events;
  try {
    events = cucache::parse_trace(text, "fuzz");
  } catch (const cucache::invalid_argument& e) {
    CUCACHE_FUZZ_CHECK(std::string_view(e.what()).starts_with("fuzz:"));
    g_counts.add(rejected);
    return 0;
  }
  g_counts.add(accepted);
  for (std::size_t i = 0; i < events.size(); ++i) g_counts.add(rows);
  const cucache::trace_summary s = cucache::summarize(events);
  CUCACHE_FUZZ_CHECK(s.events == events.size());
  CUCACHE_FUZZ_CHECK(s.allocations + s.frees + s.failures + s.sleeps + s.wakes == events.size());
  CUCACHE_FUZZ_CHECK(s.live_at_end <= s.allocations);
  CUCACHE_FUZZ_CHECK(s.threads <= events.size() && s.streams <= events.size());
  std::uint64_t sum = 0;  // the peak is at most every allocation's size added up
  bool overflow = false;
  for (const auto& ev : events) {
    if (ev.act == cucache::trace_event::action::allocate && ev.pointer != 0) {
      overflow = overflow || __builtin_add_overflow(sum, ev.size, &sum);
    }
  }
  CUCACHE_FUZZ_CHECK(overflow || s.peak_requested_bytes <= sum);

  const std::vector<cucache::trace_event> again = cucache::parse_trace(write_back(events), "again");
  CUCACHE_FUZZ_CHECK(again.size() == events.size());
  for (std::size_t i = 0; i < events.size(); ++i) {
    cucache::trace_event a = again[i];
    a.line = events[i].line;  // blank lines and the header's position may differ
    CUCACHE_FUZZ_CHECK(a == events[i]);
  }
  g_counts.add(roundtrip);
  return 0;
}
