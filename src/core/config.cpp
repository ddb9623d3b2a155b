// The CUCACHE_CONF parser: the syntax of PyTorch's PYTORCH_ALLOC_CONF (formerly, and still,
// PYTORCH_CUDA_ALLOC_CONF), "key:value,...", for the keys cucache shares with PyTorch plus its own,
// strict where PyTorch is lenient (every malformed or unknown entry throws, an unknown key with the
// nearest accepted one), and to_string, which writes a config back in the same syntax. It lives in
// the core, the lowest layer that uses `config` (size_policy), beside the size constants its rules
// are made of (docs/design.md, "Layers").
#include "cucache/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cstdlib>
#include <optional>
#include <span>
#include <system_error>
#include <utility>

#include "core/size_policy.hpp"
#include "cucache/errors.hpp"

namespace cucache {
namespace detail {
namespace {

// PyTorch refuses max_split_size_mb and max_non_split_rounding_mb below its 20 MiB large-segment
// size (kLargeBuffer): a smaller limit would make every 20 MiB segment unsplittable.
constexpr std::uint64_t k_min_split_mb = k_large_segment_bytes / k_mib;
// Entry i of roundup_power2_divisions covers [2^(i+20), 2^(i+21)); the last interval a 64-bit size
// can fall in starts at 2^63, so list keys run from 1 MiB (2^0) to 2^43 MiB.
constexpr unsigned k_max_roundup_key_log2 = 43;
constexpr std::uint64_t k_max_divisions = std::uint64_t{1} << 31;

constexpr std::string_view k_space = " \t\r\n";

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(k_space);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(k_space) - first + 1);
}

// One accepted key. `field` names the config member it sets, so an alias and its canonical key
// share it and giving both is reported as a duplicate.
struct key_spec {
  std::string_view name;
  std::string_view field;
  std::string_view forms;
  void (*parse)(std::string_view key, std::string_view value, config& out);
};

// Every accepted key, in the order messages list them. Defined below the parsers it points at;
// its size is the number of entries written (std::to_array), never a number to keep in step.
std::span<const key_spec> key_specs();

// PyTorch allocator keys that cucache recognises only to say that it does not support them.
constexpr auto k_pytorch_only_keys = std::to_array<std::string_view>({
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "pinned_free_catch_all",
    "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
    "large_segment_size_mb",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
});

std::string accepted_keys() {
  std::string out;
  for (const auto& spec : key_specs()) {
    if (!out.empty()) out += ", ";
    out += spec.name;
  }
  return out;
}

const key_spec* find_spec(std::string_view key) {
  for (const auto& spec : key_specs()) {
    if (spec.name == key) return &spec;
  }
  return nullptr;
}

char lower(char c) {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

// Edit distance (insertions, deletions, substitutions and swaps of two neighbours, each 1) between
// a and b, ignoring case: how far a typed key is from an accepted one.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> before(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const bool same = lower(a[i - 1]) == lower(b[j - 1]);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) &&
          lower(a[i - 2]) == lower(b[j - 1])) {
        cur[j] = std::min(cur[j], before[j - 2] + 1);
      }
    }
    before.swap(prev);
    prev.swap(cur);
  }
  return prev[b.size()];
}

// The accepted key nearest to an unknown one, if it is near enough to be a typo: at most 2 edits,
// or a quarter of the key's length for long keys (max_split_size -> max_split_size_mb is 3).
std::optional<std::string_view> nearest_key(std::string_view key) {
  std::optional<std::string_view> best;
  std::size_t best_distance = std::max<std::size_t>(2, key.size() / 4) + 1;
  for (const auto& spec : key_specs()) {
    const std::size_t d = edit_distance(key, spec.name);
    if (d < best_distance) {
      best_distance = d;
      best = spec.name;
    }
  }
  return best;
}

// Text of the user's echoed in a message: at most this many bytes of it.
constexpr std::size_t k_echo_bytes = 64;

/// `text` in quotes for a message; a longer one cut to its first k_echo_bytes bytes, with an
/// ellipsis and its length ("'9999...' (10240 bytes)"): a 10 KB bad value must not make a 10 KB
/// message.
std::string quoted(std::string_view text) {
  if (text.size() <= k_echo_bytes) return fmt::format("'{}'", text);
  return fmt::format("'{}...' ({} bytes)", text.substr(0, k_echo_bytes), text.size());
}

// Every parse error goes through here so that each message names the key and what it accepts.
[[noreturn]] void fail(std::string_view key, std::string_view problem) {
  if (const key_spec* spec = find_spec(key)) {
    throw invalid_argument(
        fmt::format("cucache config: key '{}': {}; accepted: {}", key, problem, spec->forms));
  }
  if (key.empty()) {
    throw invalid_argument(
        fmt::format("cucache config: {}; accepted keys: {}", problem, accepted_keys()));
  }
  throw invalid_argument(fmt::format("cucache config: key {}: {}; accepted keys: {}", quoted(key),
                                     problem, accepted_keys()));
}

[[noreturn]] void fail_value(std::string_view key, std::string_view value, std::string_view why) {
  fail(key, fmt::format("invalid value {}: {}", quoted(value), why));
}

std::uint64_t parse_uint(std::string_view key, std::string_view text) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range) fail_value(key, text, "number too large");
  if (ec != std::errc{} || end != text.data() + text.size()) {
    fail_value(key, text, "not a non-negative integer");
  }
  return v;
}

double parse_double(std::string_view key, std::string_view text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range) fail_value(key, text, "number out of range");
  if (ec != std::errc{} || end != text.data() + text.size()) {
    fail_value(key, text, "not a number");
  }
  return v;
}

std::size_t parse_mib(std::string_view key, std::string_view value) {
  const std::uint64_t mb = parse_uint(key, value);
  if (mb < k_min_split_mb) fail_value(key, value, fmt::format("must be >= {}", k_min_split_mb));
  if (mb > std::numeric_limits<std::size_t>::max() / k_mib) {
    fail_value(key, value, "too large: the size in bytes overflows");
  }
  return static_cast<std::size_t>(mb) * k_mib;
}

void parse_max_split_size(std::string_view key, std::string_view value, config& out) {
  out.max_split_size = parse_mib(key, value);
}

void parse_max_non_split_rounding(std::string_view key, std::string_view value, config& out) {
  out.max_non_split_rounding = parse_mib(key, value);
}

std::uint32_t parse_divisions(std::string_view key, std::string_view text, bool allow_zero) {
  const std::uint64_t d = parse_uint(key, text);
  if (d == 0 && allow_zero) return 0;
  if (!std::has_single_bit(d)) {
    fail_value(key, text,
               allow_zero ? "divisions must be 0 or a power of two" : "must be a power of two");
  }
  if (d > k_max_divisions) fail_value(key, text, "divisions must be <= 2^31");
  return static_cast<std::uint32_t>(d);
}

// List form, with PyTorch's meaning: a key of K MiB sets entry log2(K); the first key also fills
// every entry below it; '>' fills every entry above the last key; entries between two keys stay 0.
// Unlike PyTorch, keys must increase and '>' must come last after a key, so that no accepted list
// depends on an ordering quirk.
void parse_roundup_list(std::string_view key, std::string_view list, config& out) {
  std::vector<std::uint32_t> divs(k_roundup_power2_intervals, 0);
  std::optional<unsigned> last_index;
  bool saw_rest = false;
  const std::string_view body = list.substr(1, list.size() - 2);
  if (trim(body).empty()) fail_value(key, list, "empty list");
  std::size_t pos = 0;
  while (pos <= body.size()) {
    const std::size_t comma = std::min(body.find(',', pos), body.size());
    const std::string_view entry = trim(body.substr(pos, comma - pos));
    pos = comma + 1;
    if (entry.empty()) fail_value(key, list, "empty list entry");
    if (saw_rest) fail_value(key, list, "'>' must be the last entry");
    const std::size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      fail_value(key, list, fmt::format("entry {} lacks ':'", quoted(entry)));
    }
    const std::string_view size_text = trim(entry.substr(0, colon));
    const std::uint32_t d = parse_divisions(key, trim(entry.substr(colon + 1)), true);
    if (size_text == ">") {
      if (!last_index) fail_value(key, list, "'>' needs a size entry before it");
      std::fill(divs.begin() + *last_index + 1, divs.end(), d);
      saw_rest = true;
      continue;
    }
    const std::uint64_t mb = parse_uint(key, size_text);
    if (!std::has_single_bit(mb)) {
      fail_value(key, list, fmt::format("size {} is not a power of two MiB", quoted(size_text)));
    }
    const auto index = static_cast<unsigned>(std::countr_zero(mb));
    if (index > k_max_roundup_key_log2) {
      fail_value(key, list,
                 fmt::format("size {} MiB exceeds 2^{} MiB", quoted(size_text), k_max_roundup_key_log2));
    }
    if (!last_index) {
      std::fill(divs.begin(), divs.begin() + index, d);
    } else if (index <= *last_index) {
      fail_value(key, list, "sizes must increase from entry to entry");
    }
    divs[index] = d;
    last_index = index;
  }
  out.roundup_power2_divisions = std::move(divs);
}

void parse_roundup(std::string_view key, std::string_view value, config& out) {
  if (value.front() == '[') {
    if (value.back() != ']') fail_value(key, value, "text after the closing ']'");
    parse_roundup_list(key, value, out);
    return;
  }
  out.roundup_power2_divisions.assign(k_roundup_power2_intervals,
                                      parse_divisions(key, value, false));
}

bool parse_bool(std::string_view key, std::string_view value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  fail_value(key, value, "not a boolean");
}

void parse_gc_threshold(std::string_view key, std::string_view value, config& out) {
  const double v = parse_double(key, value);
  if (!(v > 0.0 && v < 1.0)) fail_value(key, value, "must be > 0 and < 1");
  out.garbage_collection_threshold = v;
}

void parse_expandable(std::string_view key, std::string_view value, config& out) {
  out.expandable_segments = parse_bool(key, value);
}

void parse_ipc_handles(std::string_view key, std::string_view value, config& out) {
  out.ipc_handles = parse_bool(key, value);
}

void parse_defer_coalescing(std::string_view key, std::string_view value, config& out) {
  out.defer_coalescing = parse_bool(key, value);
}

void parse_coarse_handles(std::string_view key, std::string_view value, config& out) {
  const std::uint64_t n = parse_uint(key, value);
  if (n == 1 || n > 32) fail_value(key, value, "must be 0 (off) or 2 to 32 pages");
  out.coarse_handle_pages = n;
}

void parse_peer_access(std::string_view key, std::string_view value, config& out) {
  if (value == "auto") {
    out.peer_access = peer_access_mode::automatic;
  } else if (value == "all") {
    out.peer_access = peer_access_mode::all;
  } else if (value == "none") {
    out.peer_access = peer_access_mode::none;
  } else {
    fail_value(key, value, "not auto, all or none");
  }
}

void parse_memory_fraction(std::string_view key, std::string_view value, config& out) {
  const double v = parse_double(key, value);
  if (!(v > 0.0 && v <= 1.0)) fail_value(key, value, "must be > 0 and <= 1");
  out.memory_fraction = v;
}

bool iequals(std::string_view a, std::string_view b) {
  return std::ranges::equal(a, b, [](char x, char y) { return lower(x) == lower(y); });
}

void parse_memory_limit(std::string_view key, std::string_view value, config& out) {
  const std::size_t digits_end = std::min(value.find_first_not_of("0123456789"), value.size());
  if (digits_end == 0) fail_value(key, value, "must start with a non-negative integer");
  const std::uint64_t n = parse_uint(key, value.substr(0, digits_end));
  const std::string_view unit = trim(value.substr(digits_end));
  struct unit_spec {
    std::string_view name;
    unsigned shift;
  };
  static constexpr auto units = std::to_array<unit_spec>({{"", 0},
                                                          {"B", 0},
                                                          {"K", 10},
                                                          {"KB", 10},
                                                          {"KiB", 10},
                                                          {"M", 20},
                                                          {"MB", 20},
                                                          {"MiB", 20},
                                                          {"G", 30},
                                                          {"GB", 30},
                                                          {"GiB", 30},
                                                          {"T", 40},
                                                          {"TB", 40},
                                                          {"TiB", 40}});
  std::optional<unsigned> shift;
  for (const auto& u : units) {
    if (iequals(u.name, unit)) shift = u.shift;
  }
  if (!shift) fail_value(key, value, fmt::format("unknown unit '{}'", unit));
  if (n == 0) fail_value(key, value, "must be > 0");
  if (n > (std::numeric_limits<std::size_t>::max() >> *shift)) {
    fail_value(key, value, "too large: the size in bytes overflows");
  }
  out.memory_limit_bytes = static_cast<std::size_t>(n) << *shift;
}

void parse_trace(std::string_view key, std::string_view value, config& out) {
  // Balanced brackets would get past the splitter, unbalanced ones not; refusing every bracket
  // keeps the rule simple to state: a path holds no ',', '[' or ']'.
  if (value.find_first_of("[]") != std::string_view::npos) {
    fail_value(key, value, "a path may not contain '[' or ']'");
  }
  out.trace_path = std::string(value);
}

/// reserve_mb above this (16 TiB) is taken for a typo: no device holds it.
constexpr std::uint64_t k_max_reserve_mb = std::uint64_t{1} << 24;

void parse_reserve(std::string_view key, std::string_view value, config& out) {
  const std::uint64_t mb = parse_uint(key, value);
  if (mb > k_max_reserve_mb) {
    fail_value(key, value,
               fmt::format("more than {} MiB (16 TiB), which no device holds", k_max_reserve_mb));
  }
  out.reserve_bytes = static_cast<std::size_t>(mb) << 20;
}

void parse_nvtx(std::string_view key, std::string_view value, config& out) {
  out.nvtx = parse_bool(key, value);
}

void parse_history(std::string_view key, std::string_view value, config& out) {
  const std::uint64_t n = parse_uint(key, value);
  if (n > (std::uint64_t{1} << 26)) fail_value(key, value, "at most 67108864 entries");
  out.history_entries = static_cast<std::size_t>(n);
}

void parse_leak_steps(std::string_view key, std::string_view value, config& out) {
  const std::uint64_t n = parse_uint(key, value);
  if (n == 0) fail_value(key, value, "must be >= 1");
  out.leak_steps = n;
}

void parse_record_backtraces(std::string_view key, std::string_view value, config& out) {
  if (value == "True" || value == "true" || value == "1") {
#if !CUCACHE_HAVE_BACKTRACES
    fail_value(key, value,
               "this build of cucache has no call-stack capture (it was built without libunwind: "
               "install libunwind-dev, tools/install_deps.sh, and rebuild)");
#endif
    out.record_backtraces = true;
  } else if (value == "False" || value == "false" || value == "0") {
    out.record_backtraces = false;
  } else {
    fail_value(key, value, "not a boolean");
  }
}

std::span<const key_spec> key_specs() {
  static constexpr auto specs = std::to_array<key_spec>({
      {"max_split_size_mb", "max_split_size_mb",
       "an integer number of MiB >= 20, e.g. max_split_size_mb:512", parse_max_split_size},
      {"max_non_split_rounding_mb", "max_non_split_rounding_mb",
       "an integer number of MiB >= 20, e.g. max_non_split_rounding_mb:256",
       parse_max_non_split_rounding},
      {"roundup_power2_divisions", "roundup_power2_divisions",
       "a power of two for every size interval, e.g. roundup_power2_divisions:4, or a list "
       "[<MiB>:<divisions>,...,>:<divisions>] whose sizes are increasing powers of two from 1 to "
       "2^43 MiB, whose divisions are 0 or powers of two, and whose optional '>' entry comes "
       "last, e.g. roundup_power2_divisions:[256:4,512:2,>:1]",
       parse_roundup},
      {"garbage_collection_threshold", "garbage_collection_threshold",
       "a number > 0 and < 1, e.g. garbage_collection_threshold:0.8", parse_gc_threshold},
      {"expandable_segments", "expandable_segments",
       "True, False, true, false, 1 or 0, e.g. expandable_segments:True", parse_expandable},
      {"memory_fraction", "memory_fraction",
       "a number > 0 and <= 1, e.g. memory_fraction:0.9 (alias per_process_memory_fraction)",
       parse_memory_fraction},
      {"per_process_memory_fraction", "memory_fraction",
       "a number > 0 and <= 1, e.g. per_process_memory_fraction:0.9 (alias of memory_fraction)",
       parse_memory_fraction},
      {"memory_limit", "memory_limit",
       "a positive integer number of bytes with an optional unit B, KB/KiB, MB/MiB, GB/GiB, "
       "TB/TiB, K, M, G or T (all binary, K = 1024), e.g. memory_limit:40GiB",
       parse_memory_limit},
      {"trace", "trace",
       "a non-empty file path without ',', '[' or ']' and without surrounding blanks, e.g. "
       "trace:/tmp/cucache.csv",
       parse_trace},
      {"reserve_mb", "reserve_mb",
       "an integer number of MiB from 0 (off) to 16777216, e.g. reserve_mb:4096", parse_reserve},
      {"nvtx", "nvtx", "True, False, true, false, 1 or 0, e.g. nvtx:True", parse_nvtx},
      {"history", "history",
       "a number of device-trace events to keep per device, 0 (off) to 67108864, e.g. "
       "history:100000",
       parse_history},
      {"leak_steps", "leak_steps",
       "a number of steps >= 1 an allocation must survive to be a leak candidate, e.g. "
       "leak_steps:3",
       parse_leak_steps},
      {"record_backtraces", "record_backtraces",
       "True, False, true, false, 1 or 0, e.g. record_backtraces:True (needs libunwind)",
       parse_record_backtraces},
      {"peer_access", "peer_access",
       "auto, all or none, e.g. peer_access:none (expandable segments: which other devices each "
       "mapping is made accessible to)",
       parse_peer_access},
      {"ipc_handles", "ipc_handles",
       "True, False, true, false, 1 or 0, e.g. ipc_handles:True (expandable segments: physical "
       "memory exportable as POSIX file descriptors)",
       parse_ipc_handles},
      {"coarse_handles", "coarse_handles",
       "0 (off) or a number of pages from 2 to 32, e.g. coarse_handles:8 (expandable segments: "
       "physical handles of up to that many pages while memory is plentiful)",
       parse_coarse_handles},
      {"defer_coalescing", "defer_coalescing",
       "True, False, true, false, 1 or 0, e.g. defer_coalescing:True (segments: a stream's last "
       "freed block waits unmerged for the next request, which takes it back when best fit "
       "would carve exactly it)",
       parse_defer_coalescing},
  });
  static_assert(std::ranges::none_of(specs,
                                     [](const key_spec& k) {
                                       return k.name.empty() || k.field.empty() ||
                                              k.forms.empty() || !k.parse;
                                     }),
                "every key has a name, a field, its accepted forms and a parser");
  return specs;
}

// Splits at the commas outside brackets. A bracket error is reported against the entry's key,
// which is everything before the entry's first ':'.
std::vector<std::string_view> split_entries(std::string_view text) {
  std::vector<std::string_view> entries;
  std::size_t start = 0;
  bool in_list = false;
  const auto entry_key = [&](std::size_t end) {
    const std::string_view entry = text.substr(start, end - start);
    return trim(entry.substr(0, entry.find(':')));
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '[') {
      if (in_list) fail(entry_key(i), "unbalanced brackets: '[' inside a list");
      in_list = true;
    } else if (c == ']') {
      if (!in_list) fail(entry_key(i), "unbalanced brackets: ']' without '['");
      in_list = false;
    } else if (c == ',' && !in_list) {
      entries.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  if (in_list) fail(entry_key(text.size()), "unbalanced brackets: '[' without ']'");
  entries.push_back(text.substr(start));
  return entries;
}

}  // namespace
}  // namespace detail

config parse_config(std::string_view text, config base) {
  using namespace detail;
  if (trim(text).empty()) return base;
  std::vector<std::pair<std::string_view, std::string_view>> seen;  // field, key given
  for (const std::string_view raw : split_entries(text)) {
    const std::string_view entry = trim(raw);
    if (entry.empty()) fail("", fmt::format("empty entry (stray ',') in {}", quoted(trim(text))));
    const std::size_t colon = entry.find(':');
    const std::string_view key = trim(entry.substr(0, colon));
    if (key.empty()) fail("", fmt::format("empty key in {}", quoted(entry)));
    if (std::ranges::find(k_pytorch_only_keys, key) != k_pytorch_only_keys.end()) {
      fail(key, "a PyTorch key not supported by cucache");
    }
    const key_spec* spec = find_spec(key);
    if (spec == nullptr) {
      // key=value, a shell habit: suggest the entry with ':' when the part before '=' is a key.
      if (const std::size_t eq = entry.find('=');
          eq < colon && find_spec(trim(entry.substr(0, eq))) != nullptr) {
        fail(key, fmt::format("'=' between key and value (did you mean '{}:{}'? a key and its value "
                              "are separated by ':', as in PyTorch's PYTORCH_ALLOC_CONF)",
                              trim(entry.substr(0, eq)), trim(entry.substr(eq + 1))));
      }
      const auto near = nearest_key(key);
      fail(key, near ? fmt::format("unknown key (did you mean '{}'?)", *near) : "unknown key");
    }
    if (colon == std::string_view::npos) fail(key, "missing ':' and value");
    const std::string_view value = trim(entry.substr(colon + 1));
    if (value.empty()) fail(key, "missing value after ':'");
    const auto dup = std::ranges::find(seen, spec->field, &decltype(seen)::value_type::first);
    if (dup != seen.end()) {
      fail(key, dup->second == key ? "key given twice"
                                   : fmt::format("key given twice (also as '{}')", dup->second));
    }
    seen.emplace_back(spec->field, key);
    spec->parse(key, value, base);
  }
  return base;
}

std::vector<std::pair<std::string, std::string>> config_entries(std::string_view text) {
  using namespace detail;
  std::vector<std::pair<std::string, std::string>> out;
  if (trim(text).empty()) return out;
  for (const std::string_view raw : split_entries(text)) {
    const std::string_view entry = trim(raw);
    if (entry.empty()) continue;
    const std::size_t colon = entry.find(':');
    out.emplace_back(std::string(trim(entry.substr(0, colon))),
                     colon == std::string_view::npos ? std::string()
                                                     : std::string(trim(entry.substr(colon + 1))));
  }
  return out;
}

config config_from_env() {
  const char* env = std::getenv("CUCACHE_CONF");
  if (env == nullptr) return config{};
  try {
    return parse_config(env);
  } catch (const invalid_argument& e) {
    throw invalid_argument(fmt::format("environment variable CUCACHE_CONF: {}", e.what()));
  }
}

namespace detail {
namespace {

// The list form that parse_roundup_list turns back into `divs` (when it can: see to_string).
std::string render_roundup(const std::vector<std::uint32_t>& divs) {
  if (divs.size() != k_roundup_power2_intervals) {
    return fmt::format("<{} entries instead of {}>", divs.size(), k_roundup_power2_intervals);
  }
  const auto n = divs.size();
  if (std::ranges::all_of(divs, [&](std::uint32_t d) { return d == divs[0]; }) && divs[0] != 0) {
    return fmt::format("{}", divs[0]);
  }
  // The uniform tail goes into '>', the uniform head into the first key; the rest is listed.
  std::size_t tail = n - 1;
  while (tail > 0 && divs[tail - 1] == divs[n - 1]) --tail;
  const bool use_rest = divs[n - 1] != 0;
  const std::size_t limit = std::min<std::size_t>(k_max_roundup_key_log2 + 1, use_rest ? tail : n);
  std::size_t head = 0;
  // A zero head is written as "1:0" and left implicit after that, since gaps read back as 0.
  while (divs[0] != 0 && head + 1 < limit && divs[head + 1] == divs[0]) ++head;
  std::string out = fmt::format("[{}:{}", std::uint64_t{1} << head, divs[0]);
  for (std::size_t i = head + 1; i < limit; ++i) {
    if (divs[i] != 0 || (use_rest && i + 1 == limit)) {
      out += fmt::format(",{}:{}", std::uint64_t{1} << i, divs[i]);
    }
  }
  if (use_rest) out += fmt::format(",>:{}", divs[n - 1]);
  return out + "]";
}

std::string render_bytes(std::size_t bytes) {
  static constexpr auto units = std::to_array<std::pair<unsigned, std::string_view>>(
      {{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}});
  for (const auto& [shift, name] : units) {
    if (bytes % (std::size_t{1} << shift) == 0) return fmt::format("{}{}", bytes >> shift, name);
  }
  return fmt::format("{}", bytes);
}

}  // namespace
}  // namespace detail

std::string to_string(const config& cfg) {
  using namespace detail;
  const config def{};
  std::string out;
  // Writes one field and proves, by parsing it back, that the text means the same value; a value
  // the syntax cannot express (a byte count that is no whole MiB, say) is an error, not a drift.
  const auto put = [&](std::string_view key, std::string value, auto same) {
    const std::string entry = fmt::format("{}:{}", key, value);
    bool ok = false;
    try {
      ok = same(parse_config(entry));
    } catch (const invalid_argument&) {
    }
    if (!ok) {
      throw invalid_argument(fmt::format(
          "cucache config: to_string: the value of '{}' cannot be written as '{}'; accepted: {}",
          key, value, find_spec(key)->forms));
    }
    if (!out.empty()) out += ',';
    out += entry;
  };
  if (cfg.max_split_size != def.max_split_size) {
    put("max_split_size_mb", fmt::format("{}", cfg.max_split_size / k_mib),
        [&](const config& c) { return c.max_split_size == cfg.max_split_size; });
  }
  if (cfg.max_non_split_rounding != def.max_non_split_rounding) {
    put("max_non_split_rounding_mb", fmt::format("{}", cfg.max_non_split_rounding / k_mib),
        [&](const config& c) { return c.max_non_split_rounding == cfg.max_non_split_rounding; });
  }
  if (cfg.roundup_power2_divisions != def.roundup_power2_divisions) {
    put("roundup_power2_divisions", render_roundup(cfg.roundup_power2_divisions),
        [&](const config& c) {
          return c.roundup_power2_divisions == cfg.roundup_power2_divisions;
        });
  }
  if (cfg.garbage_collection_threshold != def.garbage_collection_threshold) {
    put("garbage_collection_threshold", fmt::format("{}", cfg.garbage_collection_threshold),
        [&](const config& c) {
          return c.garbage_collection_threshold == cfg.garbage_collection_threshold;
        });
  }
  if (cfg.expandable_segments != def.expandable_segments) {
    put("expandable_segments", cfg.expandable_segments ? "True" : "False",
        [&](const config& c) { return c.expandable_segments == cfg.expandable_segments; });
  }
  if (cfg.memory_fraction != def.memory_fraction) {
    put("memory_fraction", fmt::format("{}", cfg.memory_fraction),
        [&](const config& c) { return c.memory_fraction == cfg.memory_fraction; });
  }
  if (cfg.memory_limit_bytes != def.memory_limit_bytes) {
    put("memory_limit", render_bytes(cfg.memory_limit_bytes),
        [&](const config& c) { return c.memory_limit_bytes == cfg.memory_limit_bytes; });
  }
  if (cfg.peer_access != def.peer_access) {
    put("peer_access",
        cfg.peer_access == peer_access_mode::all    ? "all"
        : cfg.peer_access == peer_access_mode::none ? "none"
                                                    : "auto",
        [&](const config& c) { return c.peer_access == cfg.peer_access; });
  }
  if (cfg.ipc_handles != def.ipc_handles) {
    put("ipc_handles", cfg.ipc_handles ? "True" : "False",
        [&](const config& c) { return c.ipc_handles == cfg.ipc_handles; });
  }
  if (cfg.coarse_handle_pages != def.coarse_handle_pages) {
    put("coarse_handles", fmt::format("{}", cfg.coarse_handle_pages),
        [&](const config& c) { return c.coarse_handle_pages == cfg.coarse_handle_pages; });
  }
  if (cfg.defer_coalescing != def.defer_coalescing) {
    put("defer_coalescing", cfg.defer_coalescing ? "True" : "False",
        [&](const config& c) { return c.defer_coalescing == cfg.defer_coalescing; });
  }
  if (cfg.trace_path != def.trace_path) {
    put("trace", cfg.trace_path, [&](const config& c) { return c.trace_path == cfg.trace_path; });
  }
  if (cfg.reserve_bytes != def.reserve_bytes) {
    put("reserve_mb", fmt::format("{}", cfg.reserve_bytes / k_mib),
        [&](const config& c) { return c.reserve_bytes == cfg.reserve_bytes; });
  }
  if (cfg.nvtx != def.nvtx) {
    put("nvtx", cfg.nvtx ? "True" : "False", [&](const config& c) { return c.nvtx == cfg.nvtx; });
  }
  if (cfg.history_entries != def.history_entries) {
    put("history", fmt::format("{}", cfg.history_entries),
        [&](const config& c) { return c.history_entries == cfg.history_entries; });
  }
  if (cfg.leak_steps != def.leak_steps) {
    put("leak_steps", fmt::format("{}", cfg.leak_steps),
        [&](const config& c) { return c.leak_steps == cfg.leak_steps; });
  }
  if (cfg.record_backtraces != def.record_backtraces) {
    put("record_backtraces", cfg.record_backtraces ? "True" : "False",
        [&](const config& c) { return c.record_backtraces == cfg.record_backtraces; });
  }
  return out;
}

}  // namespace cucache
