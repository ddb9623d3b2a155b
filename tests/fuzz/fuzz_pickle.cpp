// libFuzzer harness: the strict pickle decoder and the PyTorch snapshot reader on top of it. Any
// bytes either decode or throw cucache::invalid_argument naming "<name>: pickle: ... at byte N"
// (never anything else, never a crash: the decoder executes nothing and refuses every opcode
// that would). A document that decodes is walked to a bounded depth (a pickle can make a list
// hold itself), then read as a snapshot, which either throws invalid_argument naming the input or
// yields rows that summarize without throwing, whose counts agree with what the reader says it
// did, and whose every free names a pointer allocated before it.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "cucache/errors.hpp"
#include "cucache/snapshot_reader.hpp"
#include "cucache/trace.hpp"
#include "fuzz/fuzz_support.hpp"
#include "observe/pickle_reader.hpp"

namespace {

enum count : std::size_t { inputs, refused, decoded, snapshots, rows };
cucache::fuzz::counters<5> g_counts({"inputs", "refused by the decoder", "decoded",
                                     "read as snapshots", "rows of snapshots"});

// Touches every value reachable within `depth` levels (and at most `budget` values).
void walk(const cucache::detail::pickle_value& v, int depth, std::size_t& budget) {
  using kind = cucache::detail::pickle_value::kind;
  if (budget == 0) return;
  --budget;
  static_cast<void>(v.type_name());
  static_cast<void>(v.as_int64());
  static_cast<void>(v.as_uint64());
  static_cast<void>(v.as_double());
  static_cast<void>(v.text());
  if (depth == 0) return;
  if (v.is(kind::list) || v.is(kind::tuple)) {
    for (std::size_t i = 0; i < v.size(); ++i) walk(v.at(i), depth - 1, budget);
  } else if (v.is(kind::dict)) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      walk(v.key_at(i), depth - 1, budget);
      walk(v.value_at(i), depth - 1, budget);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_counts.add(inputs);
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const cucache::detail::pickle_document doc = cucache::detail::parse_pickle(bytes, "fuzz");
    CUCACHE_FUZZ_CHECK(doc.nodes() <= size);
    std::size_t budget = 100000;
    walk(doc.root(), 16, budget);
  } catch (const cucache::invalid_argument& e) {
    CUCACHE_FUZZ_CHECK(std::string_view(e.what()).starts_with("fuzz: pickle: "));
    g_counts.add(refused);
    return 0;
  }
  g_counts.add(decoded);
  cucache::torch_snapshot_trace t;
  try {
    t = cucache::parse_torch_snapshot(bytes, "fuzz");
  } catch (const cucache::invalid_argument& e) {
    CUCACHE_FUZZ_CHECK(std::string_view(e.what()).starts_with("fuzz: "));
    return 0;
  }
  g_counts.add(snapshots);
  for (std::size_t i = 0; i < t.events.size(); ++i) g_counts.add(rows);
  CUCACHE_FUZZ_CHECK(t.event_stacks.size() == t.events.size());
  std::unordered_set<std::uintptr_t> live;
  std::size_t allocs = 0, frees = 0, failures = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const cucache::trace_event& e = t.events[i];
    CUCACHE_FUZZ_CHECK(t.event_stacks[i] < t.stacks.size());
    if (e.act == cucache::trace_event::action::allocate) {
      ++allocs;
      CUCACHE_FUZZ_CHECK(live.insert(e.pointer).second);
    } else if (e.act == cucache::trace_event::action::free) {
      ++frees;
      CUCACHE_FUZZ_CHECK(live.erase(e.pointer) == 1);
    } else {
      CUCACHE_FUZZ_CHECK(e.act == cucache::trace_event::action::allocate_failure);
      ++failures;
    }
  }
  CUCACHE_FUZZ_CHECK(allocs == t.allocs + t.before_history_freed + t.before_history_alive);
  CUCACHE_FUZZ_CHECK(frees == t.frees + t.completions_without_request);
  CUCACHE_FUZZ_CHECK(failures == t.ooms);
  try {
    const cucache::trace_summary s = cucache::summarize(t.events);
    CUCACHE_FUZZ_CHECK(s.allocations == allocs && s.frees == frees);
  } catch (const cucache::invalid_argument&) {
    // Live requested bytes beyond 64 bits: the summary refuses them, naming the row.
  }
  static_cast<void>(t.note());
  return 0;
}
