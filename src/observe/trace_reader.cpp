// Reads and validates RMM-format CSV traces. The (decompressed) file streams through a fixed buffer
// in chunks, each split into lines parsed in place with std::from_chars: the largest real trace has
// close to a million rows, and stream-based parsing per field would dominate the time of a replay,
// while reading the whole file first would make memory follow the file instead of its events (a
// trace bad at line 2 would be read whole before its error, /dev/zero would never end). A line is
// at most k_max_line bytes, so the buffer holds any valid line whole and anything else -- binary
// data, a file with no newline -- fails at the line it starts on.
//
// Column spellings (documented in trace.hpp and docs/replay.md): Pointer is what glibc's %p
// prints -- 0x-prefixed hex, or a null spelling ("(nil)", "0x0", empty) -- so bare digits are
// refused. Stream is always hex, with or without the 0x prefix: RMM's traces and cucache's
// recorder write bare hex with the default stream as 0, so "10" is stream 0x10, never ten. Sizes
// are decimal. Live requested bytes are summed with overflow checks, and an allocate failure names
// no pointer.
//
// cucache's extension (docs/replay.md, "Tags, sleep and wake"): an optional seventh field, Tag
// (CSV-quoted when it holds a comma or a quote; only the last field can be, so the first six
// split on commas as before), and sleep / wake rows, checked against the tags asleep as the API
// checks them.
#include <zlib.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <istream>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "cucache/errors.hpp"
#include "cucache/snapshot_reader.hpp"
#include "cucache/trace.hpp"
#include "observe/trace_files.hpp"
#include "observe/name_table.hpp"

namespace cucache {

namespace {

constexpr std::size_t k_fields = 6;  // RMM's; cucache's Tag makes a seventh
// The longest line accepted. A row is about a hundred bytes at most (six fields, the longest a
// 20-digit size) plus its tag, the header 50: anything longer is not a trace, and the reader's
// buffer holds k_chunk + k_max_line bytes whatever the file.
constexpr std::size_t k_max_line = 4096;
constexpr std::size_t k_chunk = std::size_t{1} << 16;
// Offending text is quoted in messages, but a corrupt file can have megabyte-long "lines".
constexpr std::size_t k_max_quoted = 48;

// Control bytes (binary data read as a trace) and bytes >= 0x80 are written as \xNN.
std::string quoted(std::string_view text, std::size_t limit = k_max_quoted) {
  std::string out = "'";
  for (const char c : text.substr(0, limit)) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) {  // control bytes, and bytes >= 0x80: a message stays ASCII
      out += fmt::format("\\x{:02x}", u);
    } else {
      out += c;
    }
  }
  out += text.size() > limit ? "...'" : "'";
  return out;
}

[[noreturn]] void fail(std::string_view name, std::size_t line, std::string_view reason) {
  throw invalid_argument(fmt::format("{}:{}: {}", name, line, reason));
}

template <typename T>
bool parse_uint(std::string_view text, T& out, int base = 10) {
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, out, base);
  return ec == std::errc{} && p == end;
}

bool parse_pointer(std::string_view text, std::uintptr_t& out) {
  if (text.empty() || text == "(nil)") {
    out = 0;
    return true;
  }
  if (text.size() < 3 || text[0] != '0' || (text[1] != 'x' && text[1] != 'X')) return false;
  return parse_uint(text.substr(2), out, 16);
}

bool parse_stream(std::string_view text, std::uintptr_t& out) {
  if (text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
    text.remove_prefix(2);
  }
  return parse_uint(text, out, 16);
}

/// a + b, or false when it does not fit in size_t.
bool add_bytes(std::size_t a, std::size_t b, std::size_t& out) {
  if (b > std::numeric_limits<std::size_t>::max() - a) return false;
  out = a + b;
  return true;
}

bool two_digits(std::string_view text, std::size_t at, unsigned limit, std::uint64_t& out) {
  const char a = text[at];
  const char b = text[at + 1];
  if (a < '0' || a > '9' || b < '0' || b > '9') return false;
  const auto value = static_cast<unsigned>((a - '0') * 10 + (b - '0'));
  if (value >= limit) return false;
  out = value;
  return true;
}

// HH:MM:SS.f with 1 to 9 fraction digits (RMM writes 6); finer than microseconds is truncated.
bool parse_time(std::string_view text, std::uint64_t& out_us) {
  if (text.size() < 10 || text.size() > 18 || text[2] != ':' || text[5] != ':' || text[8] != '.') {
    return false;
  }
  std::uint64_t h = 0;
  std::uint64_t m = 0;
  std::uint64_t s = 0;
  if (!two_digits(text, 0, 24, h) || !two_digits(text, 3, 60, m) || !two_digits(text, 6, 60, s)) {
    return false;
  }
  std::uint64_t frac = 0;
  std::size_t digits = 0;
  for (const char c : text.substr(9)) {
    if (c < '0' || c > '9') return false;
    if (digits < 6) frac = frac * 10 + static_cast<std::uint64_t>(c - '0');
    ++digits;
  }
  for (std::size_t i = digits; i < 6; ++i) frac *= 10;
  out_us = ((h * 60 + m) * 60 + s) * 1'000'000 + frac;
  return true;
}

bool parse_action(std::string_view text, trace_event::action& out) {
  if (text == "allocate") {
    out = trace_event::action::allocate;
  } else if (text == "free") {
    out = trace_event::action::free;
  } else if (text == "allocate failure") {
    out = trace_event::action::allocate_failure;
  } else if (text == "sleep" || text == "sleep keep contents") {
    out = trace_event::action::sleep;
  } else if (text == "wake") {
    out = trace_event::action::wake;
  } else {
    return false;
  }
  return true;
}

struct file_closer {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};

// The validating parser, fed one line at a time (without its '\n'). Holds the events and the live
// allocations (pointer -> line and size of the allocate that made it live), nothing of the text.
class line_parser {
 public:
  explicit line_parser(std::string_view name) : name_(name) {}

  void line(std::string_view line);
  /// A line that is still going after k_max_line bytes, `start` its first bytes.
  [[noreturn]] void too_long(std::string_view start) const {
    const std::size_t at = line_no_ + 1;
    if (!have_header_) {
      fail(name_, at,
           fmt::format("expected header '{}', found a line longer than {} bytes starting {} (not "
                       "an RMM-format CSV trace)",
                       k_trace_header, k_max_line, quoted(start, 16)));
    }
    fail(name_, at,
         fmt::format("line longer than {} bytes starting {} (a trace row is about a hundred)",
                     k_max_line, quoted(start, 16)));
  }
  std::vector<trace_event> finish() {
    if (!have_header_) {
      fail(name_, 1, fmt::format("empty trace: expected header '{}'", k_trace_header));
    }
    return std::move(events_);
  }

 private:
  struct live_allocation {
    std::size_t line;
    std::size_t size;
    std::uint32_t tag;  // its tag's id (0: none)
  };
  /// The tag id of the Tag field's text: the last one is kept, so that a run of rows under one
  /// tag takes the process-wide table's lock once.
  std::uint32_t tag_id_of(std::string&& text) {
    if (text != last_tag_text_) {
      last_tag_id_ = trace_tag_id(text);
      last_tag_text_ = std::move(text);
    }
    return last_tag_id_;
  }
  /// Whether tag `id` sleeps: the line of its sleep, 0 when awake.
  std::size_t& asleep_since(std::uint32_t id) {
    if (asleep_since_.size() <= id) asleep_since_.resize(id + 1, 0);
    return asleep_since_[id];
  }
  static std::string_view tag_text(std::uint32_t id) { return trace_tag_name(id); }
  /// The Tag field's text: unquoted as CSV quotes it ("" for a quote inside quotes).
  std::string parse_tag(std::string_view field, std::size_t line_no) const {
    // The recorder writes control bytes of a tag as '?': a tag holding one did not come from it,
    // and could not be written back (a carriage return would read as the line's end).
    if (std::any_of(field.begin(), field.end(), [](char c) {
          const auto u = static_cast<unsigned char>(c);
          return u < 0x20 || u == 0x7f;
        })) {
      fail(name_, line_no,
           fmt::format("bad Tag {}: a control character in a tag (the recorder writes them as '?')",
                       quoted(field)));
    }
    if (!field.starts_with('"')) {
      if (field.find('"') != std::string_view::npos) {
        fail(name_, line_no,
             fmt::format("bad Tag {}: a quote in an unquoted field (quote the whole field and "
                         "double the quote)",
                         quoted(field)));
      }
      return std::string(field);
    }
    std::string out;
    std::size_t i = 1;
    for (; i < field.size(); ++i) {
      if (field[i] != '"') {
        out.push_back(field[i]);
      } else if (i + 1 < field.size() && field[i + 1] == '"') {
        out.push_back('"');
        ++i;
      } else {
        break;
      }
    }
    if (i + 1 != field.size()) {
      fail(name_, line_no,
           fmt::format("bad Tag {}: a quoted field must end with its closing quote and double "
                       "every quote inside",
                       quoted(field)));
    }
    return out;
  }
  std::string last_tag_text_;
  std::uint32_t last_tag_id_ = 0;
  std::vector<std::size_t> asleep_since_;  // by tag id: the line of its sleep, 0 when awake
  std::string_view name_;
  std::vector<trace_event> events_;
  std::unordered_map<std::uintptr_t, live_allocation> live_;
  std::size_t live_bytes_ = 0;  // requested bytes of the live allocations, checked for overflow
  std::size_t line_no_ = 0;
  bool have_header_ = false;
};

void line_parser::line(std::string_view line) {
  ++line_no_;
  const std::size_t line_no = line_no_;
  const std::string_view name = name_;
  if (line.size() > k_max_line) {
    line_no_ = line_no - 1;
    too_long(line.substr(0, k_max_quoted));
  }
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);

  if (!have_header_) {
    // Skip a UTF-8 byte-order mark that an editor may have added.
    if (line.starts_with("\xEF\xBB\xBF")) line.remove_prefix(3);
    if (line != k_trace_header && line != k_trace_header_tagged) {
      fail(name, line_no,
           fmt::format("expected header '{}', found {}", k_trace_header, quoted(line)));
    }
    have_header_ = true;
    return;
  }
  if (line.empty()) return;
  // Fields are a few bytes long: a plain loop beats a memchr call per field.
  std::array<std::string_view, k_fields> field;
  std::size_t count = 0;
  std::size_t start = 0;
  std::string_view tag_field;  // the seventh field (Tag), as written
  bool has_tag = false;
  for (std::size_t i = 0; i <= line.size(); ++i) {
    if (i < line.size() && line[i] != ',') continue;
    if (count < k_fields) field[count] = line.substr(start, i - start);
    ++count;
    start = i + 1;
    if (count == k_fields && i < line.size()) {
      // The rest is the Tag: CSV-quoted when it holds a comma or a quote.
      tag_field = line.substr(start);
      has_tag = true;
      ++count;
      if (!tag_field.starts_with('"')) {
        count += static_cast<std::size_t>(std::count(tag_field.begin(), tag_field.end(), ','));
      }
      break;
    }
  }
  if (count != k_fields && count != k_fields + 1) {
    fail(name, line_no,
         fmt::format("wrong field count: expected {} (or {} with a Tag), found {} in {}",
                     k_fields, k_fields + 1, count, quoted(line)));
  }

  trace_event ev;
  ev.line = line_no;
  if (!parse_uint(field[0], ev.thread)) {
    fail(name, line_no, fmt::format("bad number in Thread: {}", quoted(field[0])));
  }
  if (!parse_time(field[1], ev.time_us)) {
    fail(name, line_no, fmt::format("bad time {} (expected HH:MM:SS.ffffff)", quoted(field[1])));
  }
  if (!parse_action(field[2], ev.act)) {
    fail(name, line_no,
         fmt::format("unknown action {} (expected allocate, free, allocate failure, sleep, sleep "
                     "keep contents or wake)",
                     quoted(field[2])));
  }
  if (!parse_pointer(field[3], ev.pointer)) {
    fail(name, line_no, fmt::format("bad pointer {}", quoted(field[3])));
  }
  if (!parse_uint(field[4], ev.size)) {
    fail(name, line_no, fmt::format("bad number in Size: {}", quoted(field[4])));
  }
  if (!parse_stream(field[5], ev.stream)) {
    fail(name, line_no, fmt::format("bad number in Stream: {}", quoted(field[5])));
  }

  if (ev.act == trace_event::action::sleep) ev.keep_contents = field[2] != "sleep";
  if (has_tag && !tag_field.empty()) ev.tag = tag_id_of(parse_tag(tag_field, line_no));
  const bool sleep_or_wake =
      ev.act == trace_event::action::sleep || ev.act == trace_event::action::wake;
  if (sleep_or_wake) {
    if (ev.tag == 0) {
      fail(name, line_no,
           fmt::format("{} row without a tag (expected the tag in the seventh column, Tag)",
                       field[2]));
    }
    if (ev.pointer != 0) {
      fail(name, line_no,
           fmt::format("{} row with pointer {:#x} (expected (nil), 0x0 or empty)", field[2],
                       ev.pointer));
    }
    std::size_t& since = asleep_since(ev.tag);
    if (ev.act == trace_event::action::sleep) {
      if (since != 0) {
        fail(name, line_no,
             fmt::format("sleep of tag {}, which is already asleep (slept at line {})",
                         quoted(tag_text(ev.tag)), since));
      }
      since = line_no;
    } else {
      if (since == 0) {
        fail(name, line_no,
             fmt::format("wake of tag {}, which is not asleep", quoted(tag_text(ev.tag))));
      }
      since = 0;
    }
  }
  if (ev.act == trace_event::action::allocate_failure && ev.pointer != 0) {
    fail(name, line_no,
         fmt::format("allocate failure with pointer {:#x}: a failed allocation returns none "
                     "(expected (nil), 0x0 or empty)",
                     ev.pointer));
  }
  if (ev.pointer != 0) {
    if (ev.act == trace_event::action::allocate) {
      const std::uint32_t tag = ev.tag;
      if (tag != 0 && asleep_since(tag) != 0) {
        fail(name, line_no,
             fmt::format("allocate under tag {}, which is asleep (slept at line {}; the API "
                         "refuses it)",
                         quoted(tag_text(ev.tag)), asleep_since(tag)));
      }
      auto [it, inserted] = live_.try_emplace(ev.pointer, live_allocation{line_no, ev.size, tag});
      if (!inserted) {
        fail(name, line_no,
             fmt::format("allocate of {:#x}, which is already live (allocated at line {})",
                         ev.pointer, it->second.line));
      }
      if (!add_bytes(live_bytes_, ev.size, live_bytes_)) {
        fail(name, line_no,
             fmt::format("allocate of {} bytes: live requested bytes overflow (more than {} "
                         "live, which no process can hold)",
                         ev.size, std::numeric_limits<std::size_t>::max()));
      }
    } else if (ev.act == trace_event::action::free) {
      auto it = live_.find(ev.pointer);
      if (it == live_.end()) {
        fail(name, line_no,
             fmt::format("free of {:#x}, which is not live (never allocated or already freed)",
                         ev.pointer));
      }
      if (const std::uint32_t tag = it->second.tag; tag != 0 && asleep_since(tag) != 0) {
        fail(name, line_no,
             fmt::format("free of {:#x}, allocated at line {} under tag {}, which is asleep "
                         "(slept at line {}; the API refuses it)",
                         ev.pointer, it->second.line, quoted(tag_text(tag)), asleep_since(tag)));
      }
      live_bytes_ -= it->second.size;
      live_.erase(it);
    }
  }
  events_.push_back(ev);
}

// Feeds `parser` the lines of the bytes `read(buffer, n)` returns (at most n; 0 at the end),
// through one buffer of k_chunk + k_max_line bytes: a line split between reads is carried over,
// and one that outgrows k_max_line fails at once, so memory never follows the file.
template <typename Read>
std::vector<trace_event> parse_chunks(line_parser& parser, Read&& read) {
  std::unique_ptr<char[]> buf(new char[k_chunk + k_max_line + 1]);
  std::size_t carry = 0;  // bytes of an unfinished line at the front of buf
  for (;;) {
    const std::size_t n = read(buf.get() + carry, k_chunk);
    if (n == 0) break;
    const std::string_view text(buf.get(), carry + n);
    std::size_t start = 0;
    for (std::size_t nl = text.find('\n'); nl != std::string_view::npos;
         nl = text.find('\n', start)) {
      parser.line(text.substr(start, nl - start));
      start = nl + 1;
    }
    carry = text.size() - start;
    if (carry > k_max_line) parser.too_long(text.substr(start, k_max_quoted));
    std::memmove(buf.get(), text.data() + start, carry);
  }
  if (carry > 0) parser.line(std::string_view(buf.get(), carry));
  return parser.finish();
}

// read_plain and read_gzip hand `consume` a read(buffer, n) function (at most n bytes; 0 at the
// end) over the file's (decompressed) bytes, and return what it returns.
template <typename Consume>
auto read_plain(const std::filesystem::path& path, Consume&& consume) {
  std::unique_ptr<std::FILE, file_closer> file(std::fopen(path.c_str(), "rb"));
  if (!file) throw invalid_argument(fmt::format("cannot open trace file '{}'", path.string()));
  return consume([&](char* to, std::size_t n) {
    const std::size_t got = std::fread(to, 1, n, file.get());
    if (got == 0 && std::ferror(file.get())) {
      throw invalid_argument(fmt::format("error reading trace file '{}'", path.string()));
    }
    return got;
  });
}

// Inflates member after member (gzip -c a b > ab is one file of two members, as gzip reads it).
// After a member's end only another whole member or the file's end may come: zlib's gzread
// skips anything else silently, so a trace with junk appended -- or a member cut short and then
// garbage -- read as if whole (issue 30 item 10). Such bytes are refused, naming their offset.
template <typename Consume>
auto read_gzip(const std::filesystem::path& path, Consume&& consume) {
  std::unique_ptr<std::FILE, file_closer> file(std::fopen(path.c_str(), "rb"));
  if (!file) throw invalid_argument(fmt::format("cannot open trace file '{}'", path.string()));
  z_stream zs{};
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) {  // 16: a gzip wrapper, not zlib's
    throw invalid_argument(
        fmt::format("cannot decompress trace file '{}': out of memory", path.string()));
  }
  struct inflate_end {
    z_stream* z;
    ~inflate_end() { inflateEnd(z); }
  } ender{&zs};
  std::unique_ptr<unsigned char[]> in(new unsigned char[std::size_t{1} << 18]);
  std::uint64_t read_bytes = 0;     // compressed bytes read from the file so far
  std::uint64_t member_start = 0;   // where the member being inflated starts
  std::uint64_t members = 0;        // members inflated to their end
  bool between_members = false;     // the last member ended and nothing of a next one was fed
  bool eof = false;
  const auto failure = [&](std::string_view why) {
    if (members == 0) {
      return invalid_argument(
          fmt::format("cannot decompress trace file '{}': {}", path.string(), why));
    }
    return invalid_argument(fmt::format(
        "cannot decompress trace file '{}': trailing garbage at byte {}, after {} gzip "
        "member{}: not a whole gzip member ({})",
        path.string(), member_start, members, members == 1 ? "" : "s", why));
  };
  return consume([&](char* to, std::size_t n) -> std::size_t {
    const auto want = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    zs.next_out = reinterpret_cast<Bytef*>(to);
    zs.avail_out = want;
    while (zs.avail_out == want) {  // until some text comes out, or the end
      if (zs.avail_in == 0 && !eof) {
        const std::size_t got = std::fread(in.get(), 1, std::size_t{1} << 18, file.get());
        if (got == 0) {
          if (std::ferror(file.get())) {
            throw invalid_argument(fmt::format("error reading trace file '{}'", path.string()));
          }
          eof = true;
        }
        read_bytes += got;
        zs.next_in = in.get();
        zs.avail_in = static_cast<uInt>(got);
      }
      if (zs.avail_in == 0) {  // the file's end
        if (between_members) return 0;
        throw failure("unexpected end of file: the file is truncated");
      }
      between_members = false;
      const int rc = inflate(&zs, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        ++members;
        member_start = read_bytes - zs.avail_in;
        between_members = true;
        inflateReset(&zs);
      } else if (rc != Z_OK && !(rc == Z_BUF_ERROR && zs.avail_in == 0)) {
        throw failure(zs.msg != nullptr ? zs.msg : "corrupt data");
      }
    }
    return want - zs.avail_out;
  });
}

bool is_gzip(const std::filesystem::path& path) {
  std::unique_ptr<std::FILE, file_closer> file(std::fopen(path.c_str(), "rb"));
  if (!file) throw invalid_argument(fmt::format("cannot open trace file '{}'", path.string()));
  unsigned char magic[2] = {};
  return std::fread(magic, 1, 2, file.get()) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
}

}  // namespace

namespace {
// The tags of the traces read (name_table.hpp: never destroyed), apart from the library's own.
detail::name_table& trace_tags() {
  static auto* t = new detail::name_table();
  return *t;
}
}  // namespace

std::string_view trace_tag_name(std::uint32_t id) {
  return trace_tags().name(id);
}

std::uint32_t trace_tag_id(std::string_view name) {
  return name.empty() ? 0 : trace_tags().intern(name);
}

std::string_view to_string(trace_event::action act) noexcept {
  switch (act) {
    case trace_event::action::allocate:
      return "allocate";
    case trace_event::action::free:
      return "free";
    case trace_event::action::allocate_failure:
      return "allocate failure";
    case trace_event::action::sleep:
      return "sleep";
    case trace_event::action::wake:
      return "wake";
  }
  return "?";
}

std::string_view action_text(const trace_event& ev) noexcept {
  if (ev.act == trace_event::action::sleep && ev.keep_contents) return "sleep keep contents";
  return to_string(ev.act);
}

std::vector<trace_event> parse_trace(std::string_view text, std::string_view name) {
  line_parser parser(name);
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    parser.line(text.substr(0, nl));
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
  }
  return parser.finish();
}

std::vector<trace_event> parse_trace(std::istream& in, std::string_view name) {
  line_parser parser(name);
  return parse_chunks(parser, [&](char* to, std::size_t n) {
    in.read(to, static_cast<std::streamsize>(n));
    if (in.bad()) throw invalid_argument(fmt::format("error reading trace '{}'", name));
    return static_cast<std::size_t>(in.gcount());
  });
}

namespace detail {

std::string read_file_bytes(const std::filesystem::path& path, std::size_t limit) {
  const auto all = [&](auto&& read) {
    std::string out;
    constexpr std::size_t k_step = std::size_t{1} << 20;
    while (out.size() < limit) {
      const std::size_t want = std::min(k_step, limit - out.size());
      const std::size_t old = out.size();
      out.resize(old + want);
      const std::size_t got = read(out.data() + old, want);
      out.resize(old + got);
      if (got == 0) break;
    }
    return out;
  };
  return is_gzip(path) ? read_gzip(path, all) : read_plain(path, all);
}

}  // namespace detail

std::vector<trace_event> read_trace(const std::filesystem::path& path) {
  // A PyTorch memory snapshot (a pickle) reads as the trace of its one device with a history.
  if (is_torch_snapshot(path)) return read_torch_snapshot(path).events;
  const std::string name = path.string();
  line_parser parser(name);
  const auto parse = [&](auto&& read) { return parse_chunks(parser, read); };
  return is_gzip(path) ? read_gzip(path, parse) : read_plain(path, parse);
}

trace_summary summarize(const std::vector<trace_event>& events) {
  trace_summary s;
  s.events = events.size();
  std::unordered_map<std::uintptr_t, std::size_t> live;  // pointer -> requested size
  std::unordered_set<std::uintptr_t> streams;
  std::unordered_set<std::uint32_t> threads;
  std::size_t current = 0;
  for (const trace_event& ev : events) {
    streams.insert(ev.stream);
    threads.insert(ev.thread);
    switch (ev.act) {
      case trace_event::action::allocate:
        ++s.allocations;
        if (ev.tag != 0) ++s.tagged_allocations;
        if (ev.pointer == 0) break;
        if (auto [it, inserted] = live.try_emplace(ev.pointer, ev.size); !inserted) {
          // Unvalidated input: treat a repeated allocate as replacing the older one.
          current -= it->second;
          it->second = ev.size;
        }
        if (!add_bytes(current, ev.size, current)) {
          // Events that did not come through the reader (it refuses such a trace).
          throw invalid_argument(fmt::format(
              "trace summary: allocate of {} bytes (line {}): live requested bytes overflow",
              ev.size, ev.line));
        }
        s.peak_requested_bytes = std::max(s.peak_requested_bytes, current);
        break;
      case trace_event::action::free:
        ++s.frees;
        if (auto it = live.find(ev.pointer); it != live.end()) {
          current -= it->second;
          live.erase(it);
        }
        break;
      case trace_event::action::allocate_failure:
        ++s.failures;
        break;
      case trace_event::action::sleep:
        ++s.sleeps;
        break;
      case trace_event::action::wake:
        ++s.wakes;
        break;
    }
  }
  s.live_at_end = live.size();
  s.streams = streams.size();
  s.threads = threads.size();
  return s;
}

}  // namespace cucache
