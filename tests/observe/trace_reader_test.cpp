// Tests of the RMM-format trace reader: every accepted spelling, every rejection (with its line
// number), liveness checks, summary figures, and the bundled resnet50 trace.
#include <zlib.h>

#include <unistd.h>
#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <streambuf>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cucache/errors.hpp"
#include "cucache/trace.hpp"
#include "support/temp_file.hpp"

namespace cucache {
namespace {

using act = trace_event::action;

constexpr std::uint64_t k_t0 = ((19ULL * 60 + 34) * 60 + 45) * 1'000'000 + 856987;

std::string with_header(const std::string& rows) {
  return std::string(k_trace_header) + "\n" + rows;
}

// The message of the invalid_argument that parsing `text` throws; fails the test if none is.
std::string rejection(const std::string& text) {
  try {
    (void)parse_trace(std::string_view(text), "t.csv");
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted:\n" << text;
  return {};
}

// A temp_file with the helpers these tests write traces with.
class trace_file : public cucache::test::temp_file {
 public:
  using temp_file::temp_file;
  void write_plain(const std::string& text) const { write(text); }
  void write_gzip(const std::string& text) const {
    gzFile f = gzopen(path().c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())),
              static_cast<int>(text.size()));
    ASSERT_EQ(gzclose(f), Z_OK);
  }
};

const std::string k_small = with_header(
    "1,19:34:45.856987,allocate,0x7f77cfe00000,37632,0\n"
    "1,19:34:45.857170,allocate,0x7f77cfe09400,256,0x7b\n"
    "2,19:34:45.857199,allocate failure,(nil),1073741824,7b\n"
    "1,19:34:45.857221,free,0x7f77cfe00000,37632,0\n"
    "2,19:34:45.857300,allocate,0x7f77cfe00000,100,0\n"
    "2,19:34:45.857400,allocate,0x7f77d0000000,50000,0\n"
    "1,19:34:45.857500,free,0x7f77cfe09400,256,7b\n");

TEST(TraceReader, ParsesEveryField) {
  const auto events = parse_trace(std::string_view(k_small), "small");
  ASSERT_EQ(events.size(), 7U);
  const trace_event first{1, k_t0, act::allocate, 0x7f77cfe00000, 37632, 0, 2, {}, false};
  EXPECT_EQ(events[0], first);
  EXPECT_EQ(events[1].stream, 0x7bU);
  EXPECT_EQ(events[2].act, act::allocate_failure);
  EXPECT_EQ(events[2].pointer, 0U);
  EXPECT_EQ(events[2].size, 1073741824U);
  EXPECT_EQ(events[2].stream, 0x7bU);
  EXPECT_EQ(events[2].thread, 2U);
  EXPECT_EQ(events[3].act, act::free);
  EXPECT_EQ(events[3].time_us, k_t0 + 234);
  EXPECT_EQ(events[6].line, 8U);
}

TEST(TraceReader, AcceptsEveryNullPointerSpelling) {
  const auto events = parse_trace(std::string_view(with_header(
      "1,00:00:00.000000,allocate failure,(nil),10,0\n"
      "1,00:00:00.000001,allocate failure,0x0,10,0\n"
      "1,00:00:00.000002,allocate failure,,10,0\n"
      // A zero-byte allocation may return null, more than once: not a liveness violation.
      "1,00:00:00.000003,allocate,(nil),0,0\n"
      "1,00:00:00.000004,allocate,0x0,0,0\n"
      "1,00:00:00.000005,free,,0,0\n")));
  ASSERT_EQ(events.size(), 6U);
  for (const auto& ev : events) EXPECT_EQ(ev.pointer, 0U) << "line " << ev.line;
}

TEST(TraceReader, AcceptsStreamWithAndWithoutPrefix) {
  const auto events =
      parse_trace(std::string_view(with_header("1,00:00:00.000000,allocate,0x10,1,0x5603a1b0\n"
                                               "1,00:00:00.000000,allocate,0x20,1,5603a1b0\n"
                                               "1,00:00:00.000000,allocate,0x30,1,0X5603A1B0\n"
                                               "1,00:00:00.000000,allocate,0x40,1,0\n"
                                               "1,00:00:00.000000,allocate,0x50,1,0x0\n")));
  ASSERT_EQ(events.size(), 5U);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(events[i].stream, 0x5603a1b0U);
  EXPECT_EQ(events[3].stream, 0U);
  EXPECT_EQ(events[4].stream, 0U);
}

TEST(TraceReader, AcceptsCrlfBlankLinesBomAndMissingFinalNewline) {
  std::string crlf = "\xEF\xBB\xBF";
  for (char c : k_small) {
    if (c == '\n') crlf += '\r';
    crlf += c;
  }
  crlf += "\r\n\r\n";
  EXPECT_EQ(parse_trace(std::string_view(crlf)), parse_trace(std::string_view(k_small)));

  std::string no_final = k_small;
  no_final.pop_back();
  EXPECT_EQ(parse_trace(std::string_view(no_final)), parse_trace(std::string_view(k_small)));
}

TEST(TraceReader, AcceptsOtherFractionWidths) {
  const auto events =
      parse_trace(std::string_view(with_header("1,23:59:59.5,allocate,0x10,1,0\n"
                                               "1,00:00:01.123456789,free,0x10,1,0\n")));
  EXPECT_EQ(events[0].time_us, 86'399'500'000U);
  EXPECT_EQ(events[1].time_us, 1'123'456U);
}

TEST(TraceReader, HeaderOnlyIsAnEmptyTrace) {
  EXPECT_TRUE(parse_trace(std::string_view(with_header(""))).empty());
}

TEST(TraceReader, ReadsFromAStream) {
  std::istringstream in(k_small);
  EXPECT_EQ(parse_trace(in, "small"), parse_trace(std::string_view(k_small)));
}

TEST(TraceReader, ReadsPlainAndGzipFilesByContentNotName) {
  const auto expected = parse_trace(std::string_view(k_small));
  trace_file plain("cucache_trace_plain.csv.gz");  // a misleading name on purpose
  plain.write_plain(k_small);
  EXPECT_EQ(read_trace(plain.path()), expected);
  trace_file gz("cucache_trace_gzip.csv");
  gz.write_gzip(k_small);
  EXPECT_EQ(read_trace(gz.path()), expected);
}

TEST(TraceReader, RejectsMalformedRowsNamingFileLineAndReason) {
  struct bad_case {
    std::string row;
    std::string reason;
  };
  const bad_case cases[] = {
      {"1,00:00:00.000000,allocate,0x10,1",
       "wrong field count: expected 6 (or 7 with a Tag), found 5"},
      {"1,00:00:00.000000,allocate,0x10,1,0,a,b",
       "wrong field count: expected 6 (or 7 with a Tag), found 8"},
      // cucache's extension: the Tag column and sleep / wake rows.
      {"1,00:00:00.000000,allocate,0x10,1,0,a\"b", "bad Tag 'a\"b': a quote in an unquoted field"},
      {"1,00:00:00.000000,allocate,0x10,1,0,\"a", "bad Tag '\"a': a quoted field must end"},
      {"1,00:00:00.000000,allocate,0x10,1,0,a\tb", "a control character in a tag"},
      {"1,00:00:00.000000,allocate,0x10,1,0,\"a\"b\"", "bad Tag"},
      {"1,00:00:00.000000,sleep,,4096,0", "sleep row without a tag"},
      {"1,00:00:00.000000,wake,,4096,0,", "wake row without a tag"},
      {"1,00:00:00.000000,wake,,4096,0,t", "wake of tag 't', which is not asleep"},
      {"1,00:00:00.000000,sleep,0x10,4096,0,t", "sleep row with pointer 0x10"},
      {"1,00:00:00.000000,sleeps,,4096,0,t", "unknown action 'sleeps'"},
      {"x,00:00:00.000000,allocate,0x10,1,0", "bad number in Thread: 'x'"},
      {"-1,00:00:00.000000,allocate,0x10,1,0", "bad number in Thread"},
      {"99999999999,00:00:00.000000,allocate,0x10,1,0", "bad number in Thread"},
      {"1,00:00:00.000000,allocate,0x10,12a,0", "bad number in Size: '12a'"},
      {"1,00:00:00.000000,allocate,0x10,-5,0", "bad number in Size"},
      {"1,00:00:00.000000,allocate,0x10,,0", "bad number in Size"},
      {"1,00:00:00.000000,allocate,0x10,1,zz", "bad number in Stream: 'zz'"},
      {"1,00:00:00.000000,allocate,0x10,1,", "bad number in Stream"},
      {"1,00:00:00.000000,allocate,0x10,1,0x", "bad number in Stream"},
      {"1,00:00:00.000000,alloc,0x10,1,0", "unknown action 'alloc'"},
      {"1,00:00:00.000000,Free,0x10,1,0", "unknown action"},
      {"1,00:00:00.000000,,0x10,1,0", "unknown action"},
      {"1,24:00:00.000000,allocate,0x10,1,0", "bad time '24:00:00.000000'"},
      {"1,00:60:00.000000,allocate,0x10,1,0", "bad time"},
      {"1,00:00:60.000000,allocate,0x10,1,0", "bad time"},
      {"1,00:00:00,allocate,0x10,1,0", "bad time"},
      {"1,00:00:00.,allocate,0x10,1,0", "bad time"},
      {"1,0:00:00.000000,allocate,0x10,1,0", "bad time"},
      {"1,00:0a:00.000000,allocate,0x10,1,0", "bad time"},
      {"1,00:00:00.00000x,allocate,0x10,1,0", "bad time"},
      {"1,1700000000,allocate,0x10,1,0", "bad time"},
      {"1,00:00:00.000000,allocate,7f77cfe00000,1,0", "bad pointer '7f77cfe00000'"},
      {"1,00:00:00.000000,allocate,0x,1,0", "bad pointer"},
      {"1,00:00:00.000000,allocate,0xzz,1,0", "bad pointer"},
      {"1,00:00:00.000000,allocate,nil,1,0", "bad pointer"},
      {"1,00:00:00.000000,allocate,0x10000000000000000,1,0", "bad pointer"},
  };
  for (const auto& c : cases) {
    // Two good rows first, so the bad one is on line 4.
    const std::string text = with_header(
        "1,00:00:00.000000,allocate,0x1000,1,0\n"
        "1,00:00:00.000000,free,0x1000,1,0\n" +
        c.row + "\n");
    const std::string msg = rejection(text);
    EXPECT_NE(msg.find("t.csv:4: "), std::string::npos) << c.row << " -> " << msg;
    EXPECT_NE(msg.find(c.reason), std::string::npos) << c.row << " -> " << msg;
  }
}

TEST(TraceReader, RejectsMissingOrWrongHeader) {
  EXPECT_NE(rejection("").find("t.csv:1: empty trace"), std::string::npos);
  EXPECT_NE(rejection("1,00:00:00.000000,allocate,0x10,1,0\n").find("t.csv:1: expected header"),
            std::string::npos);
  EXPECT_NE(rejection("thread,time,action,pointer,size,stream\n").find("t.csv:1:"),
            std::string::npos);
}

// cucache's extension (docs/replay.md, "Trace format"): the Tag column and sleep / wake rows.
TEST(TraceReader, ReadsTagsAndSleepAndWakeRowsUnderEitherHeader) {
  const std::string rows =
      "1,00:00:00.000000,allocate,0x1000,8,0,train\n"
      "1,00:00:00.000001,allocate,0x2000,9,0\n"
      "1,00:00:00.000002,allocate,0x3000,10,0,\"a,\"\"b\"\"\"\n"
      "1,00:00:00.000003,sleep keep contents,(nil),2097152,0,train\n"
      "1,00:00:00.000004,wake,,2097152,0,train\n"
      "1,00:00:00.000005,sleep,(nil),2097152,0,train\n"
      "1,00:00:00.000006,wake,(nil),2097152,0,train\n"
      "1,00:00:00.000007,free,0x1000,8,0\n";
  for (const std::string_view header : {k_trace_header, k_trace_header_tagged}) {
    const auto ev = parse_trace(std::string(header) + "\n" + rows, "t.csv");
    ASSERT_EQ(ev.size(), 8U);
    EXPECT_EQ(trace_tag_name(ev[0].tag), "train");
    EXPECT_EQ(ev[1].tag, 0U);
    EXPECT_EQ(trace_tag_name(ev[2].tag), "a,\"b\"");
    EXPECT_EQ(ev[3].act, act::sleep);
    EXPECT_TRUE(ev[3].keep_contents);
    EXPECT_EQ(action_text(ev[3]), "sleep keep contents");
    EXPECT_EQ(ev[3].size, 2097152U);
    EXPECT_EQ(ev[3].tag, ev[0].tag);  // ids are equal exactly when names are
    EXPECT_EQ(ev[4].act, act::wake);
    EXPECT_EQ(ev[5].act, act::sleep);
    EXPECT_FALSE(ev[5].keep_contents);
    EXPECT_EQ(action_text(ev[5]), "sleep");
    // sleeps, wakes, tagged allocations of all allocations, peak requested bytes.
    const trace_summary s = summarize(ev);
    using counts = std::array<std::size_t, 5>;
    EXPECT_EQ((counts{s.sleeps, s.wakes, s.tagged_allocations, s.allocations,
                      s.peak_requested_bytes}),
              (counts{2, 2, 2, 3, 27}));
  }
}

TEST(TraceReader, RejectsWhatTheApiRefusesOfASleepingTag) {
  const std::string start =
      "1,00:00:00.000000,allocate,0x1000,8,0,train\n"
      "1,00:00:00.000001,sleep,(nil),2097152,0,train\n";
  std::string msg = rejection(with_header(start + "1,00:00:00.000002,sleep,,0,0,train\n"));
  EXPECT_NE(msg.find("t.csv:4: sleep of tag 'train', which is already asleep (slept at line 3)"),
            std::string::npos)
      << msg;
  msg = rejection(with_header(start + "1,00:00:00.000002,allocate,0x2000,8,0,train\n"));
  EXPECT_NE(msg.find("t.csv:4: allocate under tag 'train', which is asleep (slept at line 3"),
            std::string::npos)
      << msg;
  msg = rejection(with_header(start + "1,00:00:00.000002,free,0x1000,8,0\n"));
  EXPECT_NE(msg.find("t.csv:4: free of 0x1000, allocated at line 2 under tag 'train', which is "
                     "asleep (slept at line 3"),
            std::string::npos)
      << msg;
  // Other tags and untagged blocks are unaffected.
  EXPECT_NO_THROW((void)parse_trace(with_header(start +
                                                "1,00:00:00.000002,allocate,0x2000,8,0,infer\n"
                                                "1,00:00:00.000003,allocate,0x3000,8,0\n")));
}

TEST(TraceReader, QuotesOnlyAPrefixOfAHugeField) {
  const std::string msg =
      rejection(with_header("1,00:00:00.000000,allocate,0x10,1," + std::string(3000, 'q') + "\n"));
  EXPECT_LT(msg.size(), 200U);
  EXPECT_NE(msg.find("t.csv:2: bad number in Stream"), std::string::npos);
}

// Bytes >= 0x80 of a bad field are escaped in the message like control bytes: a message is
// ASCII whatever the file holds (issue 30 item 10: the replay printed them raw).
TEST(TraceReader, EscapesBytesAbove0x7fInMessages) {
  std::string msg = rejection(with_header("1,00:00:00.000000,\xff\xfe" "allocate,0x10,1,0\n"));
  EXPECT_NE(msg.find("unknown action '\\xff\\xfeallocate'"), std::string::npos) << msg;
  msg = rejection(with_header("\x80\xc3\xa9" ",00:00:00.000000,allocate,0x10,1,0\n"));
  EXPECT_NE(msg.find("'\\x80\\xc3\\xa9'"), std::string::npos) << msg;
  for (const char c : msg) {
    EXPECT_LT(static_cast<unsigned char>(c), 0x80U) << msg;
  }
  // A tag is written as it is read (UTF-8 tags are fine); only a message escapes it.
  msg = rejection(with_header("1,00:00:00.000000,wake,,0,0,caf\xc3\xa9\n"));
  EXPECT_NE(msg.find("wake of tag 'caf\\xc3\\xa9', which is not asleep"), std::string::npos)
      << msg;
}

// gzip files are one member or several concatenated (gzip -c a b); anything else after a member
// is refused by name, never ignored (issue 30 item 10: zlib's gzread skipped trailing garbage).
TEST(TraceReader, GzipTrailingGarbageIsRefusedButConcatenatedMembersAreRead) {
  const auto gzip_bytes = [](const std::string& text) {
    trace_file t("cucache_trace_member.csv");
    t.write_gzip(text);
    std::ifstream in(t.path(), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string head = with_header("1,19:34:45.856987,allocate,0x7f77cfe00000,37632,0\n");
  const std::string tail = "1,19:34:45.857221,free,0x7f77cfe00000,37632,0\n";
  trace_file gz("cucache_trace_members.csv.gz");
  // Two members: one trace.
  gz.write_plain(gzip_bytes(head) + gzip_bytes(tail));
  EXPECT_EQ(read_trace(gz.path()), parse_trace(std::string_view(head + tail), "t"));
  // Junk after the member: refused, naming the offset where it starts.
  const std::string member = gzip_bytes(head + tail);
  for (const std::string& junk :
       {std::string("junk"), std::string("\n"), std::string(16, '\0'), std::string("\x1f"),
        std::string("\x1f\x8b\x08\x00" "garbage", 11)}) {
    gz.write_plain(member + junk);
    try {
      (void)read_trace(gz.path());
      ADD_FAILURE() << "trailing bytes accepted: " << junk.size();
    } catch (const invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(gz.path().string()), std::string::npos) << msg;
      EXPECT_TRUE(msg.find(fmt::format("trailing garbage at byte {}", member.size())) !=
                      std::string::npos ||
                  msg.find(fmt::format("at byte {}", member.size())) != std::string::npos)
          << msg;
    }
  }
  // A truncated member is refused as before.
  gz.write_plain(member.substr(0, member.size() - 5));
  EXPECT_THROW((void)read_trace(gz.path()), invalid_argument);
}

TEST(TraceReader, LinesLongerThanAnyRowAreRefusedAtTheirStart) {
  std::string msg =
      rejection(with_header("1,00:00:00.000000,allocate,0x10,1," + std::string(10000, 'q') + "\n"));
  EXPECT_LT(msg.size(), 200U) << msg;
  EXPECT_NE(msg.find("t.csv:2: line longer than 4096 bytes starting '1,00:00:00"),
            std::string::npos)
      << msg;
  msg = rejection(std::string(5000, '\0'));
  EXPECT_NE(msg.find("t.csv:1: expected header"), std::string::npos) << msg;
  EXPECT_NE(msg.find("found a line longer than 4096 bytes starting '\\x00\\x00"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("not an RMM-format CSV trace"), std::string::npos) << msg;
}

// An input stream of `total` bytes made on the fly from a prefix and a repeated row, counting what
// the reader took: nothing of it is ever held whole.
class generated_buf : public std::streambuf {
 public:
  generated_buf(std::string prefix, std::string row, std::size_t total)
      : prefix_(std::move(prefix)), row_(std::move(row)), total_(total) {}
  [[nodiscard]] std::size_t served() const { return served_; }

 protected:
  int_type underflow() override {
    if (served_ >= total_) return traits_type::eof();
    chunk_.clear();
    while (chunk_.size() < (1U << 16)) {
      const std::size_t at = served_ + chunk_.size();
      if (at < prefix_.size()) {
        chunk_.append(prefix_, at, std::string::npos);
      } else {
        chunk_ += row_;
      }
    }
    chunk_.resize(std::min(chunk_.size(), total_ - served_));
    served_ += chunk_.size();
    setg(chunk_.data(), chunk_.data(), chunk_.data() + chunk_.size());
    return traits_type::to_int_type(chunk_[0]);
  }

 private:
  std::string prefix_;
  std::string row_;
  std::size_t total_;
  std::size_t served_ = 0;
  std::string chunk_;
};

TEST(TraceReader, AnErrorAtLineTwoOfAHugeStreamIsReportedAfterReadingLittle) {
  // 64 MiB of rows after a bad second line (a 10-million-row trace took 397 MB before its error).
  generated_buf buf(with_header("1,00:00:00.000000,allocate,0x10,oops,0\n"),
                    "1,00:00:00.000000,allocate,(nil),0,0\n", std::size_t{64} << 20);
  std::istream in(&buf);
  try {
    (void)parse_trace(in, "big.csv");
    ADD_FAILURE() << "accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("big.csv:2: bad number in Size: 'oops'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LE(buf.served(), std::size_t{1} << 20) << "read before the error";
}

TEST(TraceReader, EndlessZerosFailFastAsNotATrace) {
  // /dev/zero's shape: bytes without a newline, for 256 MiB (endless in the real file).
  generated_buf buf("", std::string(4096, '\0'), std::size_t{256} << 20);
  std::istream in(&buf);
  try {
    (void)parse_trace(in, "zeros");
    ADD_FAILURE() << "accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("zeros:1: expected header"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("longer than 4096 bytes"), std::string::npos) << e.what();
  }
  EXPECT_LE(buf.served(), std::size_t{1} << 20) << "read before the error";
  if (std::filesystem::exists("/dev/zero")) {
    try {
      (void)read_trace("/dev/zero");
      ADD_FAILURE() << "/dev/zero accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("/dev/zero:1: expected header"), std::string::npos)
          << e.what();
    }
  }
}

TEST(TraceReader, AGzipBombOfZerosFailsAtItsFirstLine) {
  // 64 MiB of zeros inflate from a few dozen KiB: read as lines, it fails within the first chunk.
  trace_file gz("cucache_trace_zeros.csv");
  gz.write_gzip(std::string(std::size_t{64} << 20, '\0'));
  try {
    (void)read_trace(gz.path());
    ADD_FAILURE() << "accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(":1: expected header"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("longer than 4096 bytes"), std::string::npos) << e.what();
  }
  // A valid trace split across many reads, with rows straddling the chunk boundaries.
  std::string text = std::string(k_trace_header) + "\n";
  for (int i = 0; i < 20000; ++i) {
    text += fmt::format("{},00:00:00.{:06},allocate,{:#x},{},{:x}\n", i % 7, i % 1000000,
                        0x1000 + 16 * i, 1 + i % 4096, i % 3);
  }
  trace_file big("cucache_trace_big.csv");
  big.write_gzip(text);
  const auto events = read_trace(big.path());
  ASSERT_EQ(events.size(), 20000U);
  EXPECT_EQ(events, parse_trace(std::string_view(text), big.path().string()));
  EXPECT_EQ(events.back().line, 20001U);
}

TEST(TraceReader, RejectsFreeOfAPointerNeverAllocated) {
  const std::string msg =
      rejection(with_header("1,00:00:00.000000,allocate,0x1000,8,0\n"
                            "1,00:00:00.000001,free,0x2000,8,0\n"));
  EXPECT_NE(msg.find("t.csv:3: free of 0x2000, which is not live"), std::string::npos) << msg;
}

TEST(TraceReader, RejectsDoubleFree) {
  const std::string msg =
      rejection(with_header("1,00:00:00.000000,allocate,0x1000,8,0\n"
                            "1,00:00:00.000001,free,0x1000,8,0\n"
                            "1,00:00:00.000002,free,0x1000,8,0\n"));
  EXPECT_NE(msg.find("t.csv:4: free of 0x1000, which is not live"), std::string::npos) << msg;
}

TEST(TraceReader, RejectsAllocateOfALivePointer) {
  const std::string msg =
      rejection(with_header("1,00:00:00.000000,allocate,0x1000,8,0\n"
                            "1,00:00:00.000001,allocate,0x2000,8,0\n"
                            "1,00:00:00.000002,allocate,0x1000,8,0\n"));
  EXPECT_NE(msg.find("t.csv:4: allocate of 0x1000, which is already live (allocated at line 2)"),
            std::string::npos)
      << msg;
}

TEST(TraceReader, ReusesAddressesAfterAFree) {
  const auto events =
      parse_trace(std::string_view(with_header("1,00:00:00.000000,allocate,0x1000,8,0\n"
                                               "1,00:00:00.000001,free,0x1000,8,0\n"
                                               "1,00:00:00.000002,allocate,0x1000,16,0\n"
                                               "1,00:00:00.000003,free,0x1000,16,0\n")));
  EXPECT_EQ(events.size(), 4U);
}

TEST(TraceReader, ReportsUnreadableFilesByName) {
  const std::filesystem::path missing = "/nonexistent/cucache/trace.csv.gz";
  try {
    (void)read_trace(missing);
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(missing.string()), std::string::npos) << e.what();
  }

  trace_file corrupt("cucache_trace_corrupt.csv.gz");
  corrupt.write_plain(std::string("\x1f\x8b\x08\x00garbage that does not inflate", 33));
  try {
    (void)read_trace(corrupt.path());
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(corrupt.path().string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot decompress"), std::string::npos) << e.what();
  }
}

TEST(TraceReader, RejectsATruncatedGzipFile) {
  // Big enough that the compressed stream is long, so cutting it loses real data.
  std::string text(k_trace_header);
  text += '\n';
  for (int i = 0; i < 20000; ++i) {
    text += "1,00:00:00.000000,allocate,0x" + std::to_string(0x1000 + 16 * i) + ",8,0\n";
  }
  trace_file whole("cucache_trace_whole.csv.gz");
  whole.write_gzip(text);
  std::ifstream in(whole.path(), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  trace_file cut("cucache_trace_cut.csv.gz");
  cut.write_plain(bytes.substr(0, bytes.size() / 2));
  try {
    (void)read_trace(cut.path());
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot decompress"), std::string::npos) << e.what();
  }
}

TEST(TraceSummary, ExactFiguresOnAHandWrittenTrace) {
  const trace_summary s = summarize(parse_trace(std::string_view(k_small)));
  EXPECT_EQ(s.events, 7U);
  EXPECT_EQ(s.allocations, 4U);
  EXPECT_EQ(s.frees, 2U);
  EXPECT_EQ(s.failures, 1U);
  // Live after each allocate: 37632, 37888, (free 37632) 256 -> 356 -> 50356.
  EXPECT_EQ(s.peak_requested_bytes, 50356U);
  EXPECT_EQ(s.live_at_end, 2U);
  EXPECT_EQ(s.streams, 2U);
  EXPECT_EQ(s.threads, 2U);
}

TEST(TraceReader, StreamIsAlwaysHexWithAnOptionalPrefixPointerNeedsTheSpelledPrefix) {
  // The decision (trace.hpp, docs/replay.md): Stream is hex, with or without 0x (RMM's traces
  // and cucache's recorder write bare hex, the default stream as 0), so "10" is stream 0x10, not
  // ten. Pointer is what %p prints: 0x-prefixed hex, or a null spelling; bare digits are refused.
  const auto events =
      parse_trace(std::string_view(with_header("1,00:00:00.000000,allocate,0x10,1,10\n"
                                               "1,00:00:00.000000,allocate,0x20,1,0x10\n"
                                               "1,00:00:00.000000,allocate,0x30,1,aB\n")));
  ASSERT_EQ(events.size(), 3U);
  EXPECT_EQ(events[0].stream, 0x10U);
  EXPECT_EQ(events[1].stream, 0x10U);
  EXPECT_EQ(events[2].stream, 0xabU);
  EXPECT_NE(rejection(with_header("1,00:00:00.000000,allocate,10,1,0\n")).find("bad pointer '10'"),
            std::string::npos);
  for (const char* stream : {"-1", "+1", "0x-1", " 1", "1 ", "0xx1", "1g", "10000000000000000"}) {
    SCOPED_TRACE(stream);
    EXPECT_NE(
        rejection(with_header(std::string("1,00:00:00.000000,allocate,0x10,1,") + stream + "\n"))
            .find("bad number in Stream"),
        std::string::npos);
  }
}

TEST(TraceReader, RejectsAnAllocateFailureWithAPointer) {
  const std::string msg =
      rejection(with_header("1,00:00:00.000000,allocate failure,0x7f0000000000,1024,0\n"));
  EXPECT_NE(msg.find("t.csv:2:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("allocate failure"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0x7f0000000000"), std::string::npos) << msg;
  // Every null spelling is still accepted (AcceptsEveryNullPointerSpelling).
}

TEST(TraceReader, RejectsLiveBytesThatOverflow) {
  // Two live 2^63-byte allocations sum to 2^64: no process held that; the summary's peak once
  // wrapped to 2^63.
  const std::string rows =
      "1,00:00:00.000000,allocate,0x10,9223372036854775808,0\n"
      "1,00:00:00.000001,allocate,0x20,9223372036854775808,0\n";
  const std::string msg = rejection(with_header(rows));
  EXPECT_NE(msg.find("t.csv:3:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overflow"), std::string::npos) << msg;
  // Freed in between, the same sizes are fine: only live bytes count.
  const auto events = parse_trace(
      std::string_view(with_header("1,00:00:00.000000,allocate,0x10,9223372036854775808,0\n"
                                   "1,00:00:00.000001,free,0x10,9223372036854775808,0\n"
                                   "1,00:00:00.000002,allocate,0x20,18446744073709551615,0\n")));
  EXPECT_EQ(summarize(events).peak_requested_bytes, 18446744073709551615U);
}

TEST(TraceSummary, RefusesEventsWhoseLiveBytesOverflow) {
  // Events built by hand skip the reader's check; summarize refuses them rather than wrap.
  std::vector<trace_event> events(2);
  events[0] = {1, 0, act::allocate, 0x10, std::size_t{1} << 63, 0, 7, {}, false};
  events[1] = {1, 0, act::allocate, 0x20, std::size_t{1} << 63, 0, 8, {}, false};
  try {
    (void)summarize(events);
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("line 8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("overflow"), std::string::npos) << e.what();
  }
}

TEST(TraceSummary, EmptyTrace) {
  const trace_summary s = summarize({});
  EXPECT_EQ(s.events, 0U);
  EXPECT_EQ(s.peak_requested_bytes, 0U);
  EXPECT_EQ(s.streams, 0U);
}

TEST(TraceReader, BundledResnet50Trace) {
  const auto events =
      read_trace(std::filesystem::path(CUCACHE_SOURCE_DIR) / "traces" / "resnet50_train.csv.gz");
  const trace_summary s = summarize(events);
  EXPECT_EQ(s.events, 13683U);
  EXPECT_EQ(s.allocations, 6843U);
  EXPECT_EQ(s.frees, 6840U);
  EXPECT_EQ(s.failures, 0U);
  // traces/reference.json: resnet50_train.peak_requested_bytes.
  EXPECT_EQ(s.peak_requested_bytes, 3192592912U);
  EXPECT_EQ(s.live_at_end, 3U);
  EXPECT_EQ(s.streams, 1U);
  EXPECT_EQ(s.threads, 1U);
  const trace_event first{1, k_t0, act::allocate, 0x7f77cfe00000, 37632, 0, 2, {}, false};
  EXPECT_EQ(events.front(), first);
  EXPECT_EQ(events.back().line, 13684U);
}

}  // namespace
}  // namespace cucache
