// Helpers of the replay tool's tests (replay_test, replay_timeline_test, replay_advise_test): trace
// text built row by row, and cucache-replay's command line run in-process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cucache/trace.hpp"
#include "replay_engine.hpp"

namespace cucache::replay::test {

/// Builds RMM-format trace text row by row, every row on one thread, the n-th row at
/// `clock`.(n microseconds); times do not matter to the replay.
class trace_builder {
 public:
  explicit trace_builder(unsigned thread = 1, const char* clock = "00:00:00")
      : thread_(thread), clock_(clock) {}
  trace_builder& alloc(std::uintptr_t ptr, std::size_t size, std::uintptr_t stream = 0) {
    return row("allocate", ptr, size, stream);
  }
  trace_builder& free(std::uintptr_t ptr, std::size_t size, std::uintptr_t stream = 0) {
    return row("free", ptr, size, stream);
  }
  /// cucache's extension (docs/replay.md, "Trace format"): an allocation under `tag`, and sleep
  /// and wake rows of a tag, with the bytes released / mapped again in Size.
  trace_builder& alloc_tagged(std::uintptr_t ptr, std::size_t size, const std::string& tag,
                              std::uintptr_t stream = 0) {
    return row("allocate", ptr, size, stream, tag);
  }
  trace_builder& sleep(const std::string& tag, std::size_t bytes, bool keep_contents = false) {
    return row(keep_contents ? "sleep keep contents" : "sleep", 0, bytes, 0, tag);
  }
  trace_builder& wake(const std::string& tag, std::size_t bytes) {
    return row("wake", 0, bytes, 0, tag);
  }
  [[nodiscard]] std::string text() const {
    return std::string(k_trace_header) + "\n" + rows_.str();
  }

 private:
  trace_builder& row(const char* action, std::uintptr_t ptr, std::size_t size,
                     std::uintptr_t stream, const std::string& tag = {}) {
    ++n_;
    rows_ << thread_ << ',' << clock_ << '.' << std::setw(6) << std::setfill('0') << n_ << ','
          << action << ",0x" << std::hex << ptr << std::dec << ',' << size << ",0x" << std::hex
          << stream << std::dec;
    if (!tag.empty()) rows_ << ',' << tag;
    rows_ << '\n';
    return *this;
  }
  unsigned thread_;
  const char* clock_;
  std::ostringstream rows_;
  unsigned n_ = 0;
};

/// What one in-process run of cucache-replay's command line printed, and its exit status.
struct cli_run {
  int status = 0;
  std::string out;
  std::string err;
};

inline cli_run run(std::vector<std::string> args) {
  args.insert(args.begin(), "cucache-replay");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out;
  std::ostringstream err;
  cli_run r;
  r.status = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

/// One JSON document per line (--json output).
inline std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

}  // namespace cucache::replay::test
