// Tests of the CUCACHE_CONF parser (src/core/config.cpp): exact values for every key, both
// roundup_power2_divisions forms, every error path (the message must name the key), suggestions
// for mistyped keys, to_string round trips and the environment variable.
#include "cucache/config.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "cucache/errors.hpp"

namespace cucache {
namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

// The message of the invalid_argument that parse_config(text) throws; fails the test if none.
std::string parse_error(const std::string& text) {
  try {
    (void)parse_config(text);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse_config accepted '" << text << "'";
  return {};
}

void expect_error(const std::string& text, const std::string& key, const std::string& detail) {
  const std::string msg = parse_error(text);
  EXPECT_NE(msg.find("'" + key + "'"), std::string::npos) << text << " -> " << msg;
  EXPECT_NE(msg.find(detail), std::string::npos) << text << " -> " << msg;
  EXPECT_NE(msg.find("accepted"), std::string::npos) << text << " -> " << msg;
}

std::vector<std::uint32_t> divisions(
    std::initializer_list<std::pair<std::size_t, std::uint32_t>> runs) {
  std::vector<std::uint32_t> v;
  for (const auto& [count, value] : runs) v.insert(v.end(), count, value);
  EXPECT_EQ(v.size(), k_roundup_power2_intervals);
  return v;
}

TEST(ConfigParse, EmptyAndBlankGiveDefaultsOrBase) {
  EXPECT_EQ(parse_config(""), config{});
  EXPECT_EQ(parse_config("  \t "), config{});
  config base;
  base.memory_fraction = 0.5;
  EXPECT_EQ(parse_config("", base), base);
}

TEST(ConfigParse, DefaultsAreDocumented) {
  const config c;
  EXPECT_EQ(c.max_split_size, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(c.max_non_split_rounding, 20 * k_mib);
  EXPECT_TRUE(c.roundup_power2_divisions.empty());
  EXPECT_EQ(c.garbage_collection_threshold, 0.0);
  EXPECT_FALSE(c.expandable_segments);
  EXPECT_EQ(c.memory_fraction, 0.0);
  EXPECT_EQ(c.memory_limit_bytes, 0u);
  EXPECT_TRUE(c.trace_path.empty());
}

TEST(ConfigParse, MaxSplitSize) {
  EXPECT_EQ(parse_config("max_split_size_mb:512").max_split_size, 512 * k_mib);
  EXPECT_EQ(parse_config("max_split_size_mb:20").max_split_size, 20 * k_mib);
  const std::size_t top = std::numeric_limits<std::size_t>::max() >> 20;
  EXPECT_EQ(parse_config("max_split_size_mb:" + std::to_string(top)).max_split_size, top << 20);
  expect_error("max_split_size_mb:19", "max_split_size_mb", "must be >= 20");
  expect_error("max_split_size_mb:0", "max_split_size_mb", "must be >= 20");
  expect_error("max_split_size_mb:" + std::to_string(top + 1), "max_split_size_mb", "overflows");
  expect_error("max_split_size_mb:99999999999999999999999", "max_split_size_mb", "too large");
  expect_error("max_split_size_mb:-5", "max_split_size_mb", "not a non-negative integer");
  expect_error("max_split_size_mb:12abc", "max_split_size_mb", "not a non-negative integer");
  expect_error("max_split_size_mb:1.5", "max_split_size_mb", "not a non-negative integer");
  expect_error("max_split_size_mb:+64", "max_split_size_mb", "not a non-negative integer");
  expect_error("max_split_size_mb:6 4", "max_split_size_mb", "not a non-negative integer");
}

TEST(ConfigParse, MaxNonSplitRounding) {
  EXPECT_EQ(parse_config("max_non_split_rounding_mb:1024").max_non_split_rounding, 1024 * k_mib);
  expect_error("max_non_split_rounding_mb:8", "max_non_split_rounding_mb", "must be >= 20");
  expect_error("max_non_split_rounding_mb:x", "max_non_split_rounding_mb", "not a non-negative");
}

TEST(ConfigParse, RoundupSingleValueFillsEveryInterval) {
  EXPECT_EQ(parse_config("roundup_power2_divisions:4").roundup_power2_divisions,
            divisions({{64, 4}}));
  EXPECT_EQ(parse_config("roundup_power2_divisions:1").roundup_power2_divisions,
            divisions({{64, 1}}));
  expect_error("roundup_power2_divisions:0", "roundup_power2_divisions", "power of two");
  expect_error("roundup_power2_divisions:3", "roundup_power2_divisions", "power of two");
  expect_error("roundup_power2_divisions:4294967296", "roundup_power2_divisions", "<= 2^31");
  expect_error("roundup_power2_divisions:four", "roundup_power2_divisions", "not a non-negative");
}

TEST(ConfigParse, RoundupListFirstKeyFillsBelowAndRestFillsAbove) {
  // 256 MiB = 2^8 MiB -> entry 8, i.e. [256 MiB, 512 MiB); entries 0..7 take the first value too.
  EXPECT_EQ(parse_config("roundup_power2_divisions:[256:4,512:2,>:1]").roundup_power2_divisions,
            divisions({{9, 4}, {1, 2}, {54, 1}}));
  // PyTorch's documented example.
  EXPECT_EQ(
      parse_config("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions,
      divisions({{9, 1}, {1, 2}, {1, 4}, {53, 8}}));
  // Whitespace around list tokens is tolerated.
  EXPECT_EQ(parse_config(" roundup_power2_divisions : [ 256 : 4 , 512:2 , > : 1 ] ")
                .roundup_power2_divisions,
            divisions({{9, 4}, {1, 2}, {54, 1}}));
}

TEST(ConfigParse, RoundupListGapsAndTailStayZero) {
  // Like PyTorch: entries between two keys and above the last key (without '>') are 0.
  EXPECT_EQ(parse_config("roundup_power2_divisions:[64:4,1024:2]").roundup_power2_divisions,
            divisions({{7, 4}, {3, 0}, {1, 2}, {53, 0}}));
  EXPECT_EQ(parse_config("roundup_power2_divisions:[1:8]").roundup_power2_divisions,
            divisions({{1, 8}, {63, 0}}));
  EXPECT_EQ(parse_config("roundup_power2_divisions:[2:0,4:16,>:0]").roundup_power2_divisions,
            divisions({{2, 0}, {1, 16}, {61, 0}}));
  // The largest key, 2^43 MiB, sets entry 43 (sizes from 2^63 bytes); '>' fills 44..63.
  EXPECT_EQ(parse_config("roundup_power2_divisions:[8796093022208:2,>:4]").roundup_power2_divisions,
            divisions({{44, 2}, {20, 4}}));
}

TEST(ConfigParse, RoundupListErrors) {
  const std::string k = "roundup_power2_divisions";
  expect_error(k + ":[]", k, "empty list");
  expect_error(k + ":[256:4,]", k, "empty list entry");
  expect_error(k + ":[256:4,,>:1]", k, "empty list entry");
  expect_error(k + ":[256]", k, "lacks ':'");
  expect_error(k + ":[300:4]", k, "not a power of two MiB");
  expect_error(k + ":[0:4]", k, "not a power of two MiB");
  expect_error(k + ":[17592186044416:4]", k, "exceeds 2^43 MiB");
  expect_error(k + ":[256:3]", k, "0 or a power of two");
  expect_error(k + ":[256:x]", k, "not a non-negative integer");
  expect_error(k + ":[512:4,256:2]", k, "sizes must increase");
  expect_error(k + ":[256:4,256:2]", k, "sizes must increase");
  expect_error(k + ":[>:4]", k, "'>' needs a size entry before it");
  expect_error(k + ":[256:4,>:1,1024:2]", k, "'>' must be the last entry");
  expect_error(k + ":[256:4,>:1,>:2]", k, "'>' must be the last entry");
  expect_error(k + ":[256:4]x", k, "after the closing ']'");
  expect_error(k + ":[256:4", k, "'[' without ']'");
  expect_error(k + ":256:4]", k, "']' without '['");
  expect_error(k + ":[[256:4]]", k, "'[' inside a list");
}

TEST(ConfigParse, GarbageCollectionThreshold) {
  EXPECT_EQ(parse_config("garbage_collection_threshold:0.8").garbage_collection_threshold, 0.8);
  EXPECT_EQ(parse_config("garbage_collection_threshold:1e-3").garbage_collection_threshold, 1e-3);
  const std::string k = "garbage_collection_threshold";
  expect_error(k + ":0", k, "must be > 0 and < 1");
  expect_error(k + ":1", k, "must be > 0 and < 1");
  expect_error(k + ":1.5", k, "must be > 0 and < 1");
  expect_error(k + ":-0.5", k, "must be > 0 and < 1");
  expect_error(k + ":nan", k, "must be > 0 and < 1");
  expect_error(k + ":inf", k, "must be > 0 and < 1");
  expect_error(k + ":1e-999", k, "out of range");
  expect_error(k + ":0.5x", k, "not a number");
  expect_error(k + ":abc", k, "not a number");
}

TEST(ConfigParse, ExpandableSegments) {
  for (const char* t : {"True", "true", "1"}) {
    EXPECT_TRUE(parse_config(std::string("expandable_segments:") + t).expandable_segments) << t;
  }
  config on;
  on.expandable_segments = true;
  for (const char* f : {"False", "false", "0"}) {
    EXPECT_FALSE(parse_config(std::string("expandable_segments:") + f, on).expandable_segments)
        << f;
  }
  expect_error("expandable_segments:yes", "expandable_segments", "not a boolean");
  expect_error("expandable_segments:TRUE", "expandable_segments", "not a boolean");
  expect_error("expandable_segments:2", "expandable_segments", "not a boolean");
}

TEST(ConfigParse, CoarseHandles) {
  // On by default (8 pages; it matters only with expandable_segments); 0 turns it off.
  EXPECT_EQ(config{}.coarse_handle_pages, 8u);
  EXPECT_EQ(parse_config("expandable_segments:True").coarse_handle_pages, 8u);
  EXPECT_EQ(parse_config("coarse_handles:0").coarse_handle_pages, 0u);
  EXPECT_EQ(parse_config("coarse_handles:2").coarse_handle_pages, 2u);
  EXPECT_EQ(parse_config("coarse_handles:32").coarse_handle_pages, 32u);
  config off;
  off.coarse_handle_pages = 0;
  EXPECT_EQ(parse_config("coarse_handles:8", off).coarse_handle_pages, 8u);
  expect_error("coarse_handles:1", "coarse_handles", "must be 0 (off) or 2 to 32 pages");
  expect_error("coarse_handles:33", "coarse_handles", "must be 0 (off) or 2 to 32 pages");
  expect_error("coarse_handles:-4", "coarse_handles", "");
  expect_error("coarse_handles:True", "coarse_handles", "");
  EXPECT_EQ(to_string(config{}), "");
  EXPECT_EQ(to_string(off), "coarse_handles:0");
  EXPECT_EQ(parse_config(to_string(off)), off);
  config wide;
  wide.coarse_handle_pages = 32;
  EXPECT_EQ(to_string(wide), "coarse_handles:32");
}

TEST(ConfigParse, DeferCoalescing) {
  // Off by default; the booleans' spellings; written back only when on.
  EXPECT_FALSE(config{}.defer_coalescing);
  for (const char* on : {"defer_coalescing:True", "defer_coalescing:true", "defer_coalescing:1"})
    EXPECT_TRUE(parse_config(on).defer_coalescing) << on;
  config set;
  set.defer_coalescing = true;
  EXPECT_FALSE(parse_config("defer_coalescing:False", set).defer_coalescing);
  EXPECT_FALSE(parse_config("defer_coalescing:0", set).defer_coalescing);
  EXPECT_TRUE(parse_config("max_split_size_mb:64", set).defer_coalescing);
  expect_error("defer_coalescing:yes", "defer_coalescing", "not a boolean");
  expect_error("defer_coalescing:", "defer_coalescing", "");
  EXPECT_EQ(to_string(set), "defer_coalescing:True");
  EXPECT_EQ(parse_config(to_string(set)), set);
}

TEST(ConfigParse, MemoryFractionAndAlias) {
  EXPECT_EQ(parse_config("memory_fraction:0.9").memory_fraction, 0.9);
  EXPECT_EQ(parse_config("memory_fraction:1").memory_fraction, 1.0);
  EXPECT_EQ(parse_config("per_process_memory_fraction:0.25").memory_fraction, 0.25);
  expect_error("memory_fraction:0", "memory_fraction", "must be > 0 and <= 1");
  expect_error("memory_fraction:1.01", "memory_fraction", "must be > 0 and <= 1");
  expect_error("per_process_memory_fraction:2", "per_process_memory_fraction", "<= 1");
  expect_error("memory_fraction:half", "memory_fraction", "not a number");
}

TEST(ConfigParse, MemoryLimitUnits) {
  const auto limit = [](const std::string& v) {
    return parse_config("memory_limit:" + v).memory_limit_bytes;
  };
  EXPECT_EQ(limit("4096"), 4096u);
  EXPECT_EQ(limit("7B"), 7u);
  EXPECT_EQ(limit("3K"), 3u << 10);
  EXPECT_EQ(limit("3KB"), 3u << 10);
  EXPECT_EQ(limit("3KiB"), 3u << 10);
  EXPECT_EQ(limit("5M"), std::size_t{5} << 20);
  EXPECT_EQ(limit("5MB"), std::size_t{5} << 20);
  EXPECT_EQ(limit("5MiB"), std::size_t{5} << 20);
  EXPECT_EQ(limit("40G"), std::size_t{40} << 30);
  EXPECT_EQ(limit("40GB"), std::size_t{40} << 30);
  EXPECT_EQ(limit("40GiB"), std::size_t{40} << 30);
  EXPECT_EQ(limit("40 gib"), std::size_t{40} << 30);
  EXPECT_EQ(limit("2T"), std::size_t{2} << 40);
  EXPECT_EQ(limit("2TB"), std::size_t{2} << 40);
  EXPECT_EQ(limit("2TiB"), std::size_t{2} << 40);
  EXPECT_EQ(limit("16777215TiB"), std::size_t{16777215} << 40);
  expect_error("memory_limit:0", "memory_limit", "must be > 0");
  expect_error("memory_limit:0GiB", "memory_limit", "must be > 0");
  expect_error("memory_limit:16777216TiB", "memory_limit", "overflows");
  expect_error("memory_limit:99999999999999999999", "memory_limit", "too large");
  expect_error("memory_limit:4PB", "memory_limit", "unknown unit 'PB'");
  expect_error("memory_limit:1.5GiB", "memory_limit", "unknown unit");
  expect_error("memory_limit:GiB", "memory_limit", "must start with a non-negative integer");
  expect_error("memory_limit:-1", "memory_limit", "must start with a non-negative integer");
}

TEST(ConfigParse, Trace) {
  EXPECT_EQ(parse_config("trace:/tmp/run.csv").trace_path, "/tmp/run.csv");
  EXPECT_EQ(parse_config("trace: C:/traces/run 1.csv ").trace_path, "C:/traces/run 1.csv");
  expect_error("trace:", "trace", "missing value");
  expect_error("trace:  ", "trace", "missing value");
  expect_error("trace:/tmp/run[1].csv", "trace", "may not contain '[' or ']'");
}

TEST(ConfigParse, HistoryLeakStepsAndBacktraces) {
  EXPECT_EQ(parse_config("history:100000").history_entries, 100000u);
  EXPECT_EQ(parse_config("history:0").history_entries, 0u);
  expect_error("history:many", "history", "not a non-negative integer");
  expect_error("history:67108865", "history", "at most 67108864 entries");
  EXPECT_EQ(parse_config("leak_steps:3").leak_steps, 3u);
  expect_error("leak_steps:0", "leak_steps", "must be >= 1");
  expect_error("leak_steps:-1", "leak_steps", "not a non-negative integer");
  expect_error("record_backtraces:maybe", "record_backtraces", "not a boolean");
  EXPECT_FALSE(parse_config("record_backtraces:False").record_backtraces);
#if CUCACHE_TEST_HAVE_BACKTRACES
  EXPECT_TRUE(parse_config("record_backtraces:True").record_backtraces);
  const config c = parse_config("history:64,leak_steps:5,record_backtraces:True");
  EXPECT_EQ(to_string(c), "history:64,leak_steps:5,record_backtraces:True");
  EXPECT_EQ(parse_config(to_string(c)), c);
#else
  expect_error("record_backtraces:True", "record_backtraces", "built without libunwind");
#endif
}

TEST(ConfigParse, AllKeysTogetherWithWhitespace) {
  const config c = parse_config(
      " max_split_size_mb : 256 ,max_non_split_rounding_mb:64, "
      "roundup_power2_divisions:[128:2,>:4],garbage_collection_threshold:0.6,"
      "expandable_segments:True , per_process_memory_fraction:0.75,memory_limit:8GiB,"
      "trace:/tmp/t.csv");
  config want;
  want.max_split_size = 256 * k_mib;
  want.max_non_split_rounding = 64 * k_mib;
  want.roundup_power2_divisions = divisions({{8, 2}, {56, 4}});
  want.garbage_collection_threshold = 0.6;
  want.expandable_segments = true;
  want.memory_fraction = 0.75;
  want.memory_limit_bytes = std::size_t{8} << 30;
  want.trace_path = "/tmp/t.csv";
  EXPECT_EQ(c, want);
}

TEST(ConfigParse, ParsesOnTopOfBase) {
  config base;
  base.memory_limit_bytes = 123;
  base.roundup_power2_divisions = divisions({{64, 2}});
  const config c = parse_config("roundup_power2_divisions:[4:8]", base);
  EXPECT_EQ(c.memory_limit_bytes, 123u);
  // A given key replaces its field entirely: nothing of base's list survives.
  EXPECT_EQ(c.roundup_power2_divisions, divisions({{3, 8}, {61, 0}}));
}

TEST(ConfigParse, StructuralErrors) {
  // An unknown key lists every accepted key.
  const std::string unknown = parse_error("max_split_size:64");
  EXPECT_NE(unknown.find("'max_split_size'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("unknown key"), std::string::npos) << unknown;
  for (const char* key :
       {"max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
        "garbage_collection_threshold", "expandable_segments", "memory_fraction",
        "per_process_memory_fraction", "memory_limit", "trace", "peer_access", "ipc_handles",
        "coarse_handles"}) {
    EXPECT_NE(unknown.find(key), std::string::npos) << key;
  }
  expect_error("bogus", "bogus", "unknown key");
  expect_error("max_split_size_mb", "max_split_size_mb", "missing ':'");
  expect_error("max_split_size_mb:", "max_split_size_mb", "missing value");
  expect_error("max_split_size_mb:64,max_split_size_mb:128", "max_split_size_mb", "given twice");
  expect_error("memory_fraction:0.5,per_process_memory_fraction:0.5", "per_process_memory_fraction",
               "also as 'memory_fraction'");
  EXPECT_NE(parse_error(":5").find("empty key"), std::string::npos);
  EXPECT_NE(parse_error("expandable_segments:True,").find("empty entry"), std::string::npos);
  EXPECT_NE(parse_error(",expandable_segments:True").find("empty entry"), std::string::npos);
  EXPECT_NE(parse_error("expandable_segments:True,,trace:x").find("empty entry"),
            std::string::npos);
  expect_error("trace:/a]b", "trace", "']' without '['");
}

// A stray comma is reported as such, with the text it is in and the full list of accepted keys --
// not as a key '' whose accepted forms are empty (a key table declared one entry longer than it
// was filled held a blank entry that find_spec("") found).
TEST(ConfigParse, StrayCommaNamesTheTextAndListsEveryKey) {
  const std::string msg = parse_error("expandable_segments:True,");
  EXPECT_EQ(
      msg,
      "cucache config: empty entry (stray ',') in 'expandable_segments:True,'; accepted keys: "
      "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, "
      "garbage_collection_threshold, expandable_segments, memory_fraction, "
      "per_process_memory_fraction, memory_limit, trace, reserve_mb, nvtx, history, "
      "leak_steps, record_backtraces, peer_access, ipc_handles, coarse_handles, defer_coalescing");
  EXPECT_EQ(msg.find("key ''"), std::string::npos) << msg;
  const std::string empty_key = parse_error(":5");
  EXPECT_NE(empty_key.find("accepted keys: max_split_size_mb,"), std::string::npos) << empty_key;
}

// A long bad value, key or entry is echoed cut short with an ellipsis and its length, not whole:
// a 10 KB value made a 10 KB message (issue 30 item 10).
TEST(ConfigParse, LongBadTextIsEchoedCutShortWithItsLength) {
  const std::string long_value(10'240, '9');
  const std::string head(64, '9');
  for (const std::string& text :
       {"max_split_size_mb:" + long_value + "x", "garbage_collection_threshold:" + long_value,
        "expandable_segments:" + long_value, "roundup_power2_divisions:[" + long_value + "]",
        "roundup_power2_divisions:[64:1," + long_value + "]", long_value + ":1",
        long_value + ","}) {
    const std::string msg = parse_error(text);
    SCOPED_TRACE(msg.substr(0, 300));
    EXPECT_LT(msg.size(), 1'000u) << "the bad text was echoed whole";
    EXPECT_NE(msg.find(head + "..."), std::string::npos);
    EXPECT_NE(msg.find(" bytes)"), std::string::npos) << "the length is not said";
  }
  // The length said is the echoed text's own.
  const std::string msg = parse_error("expandable_segments:" + long_value);
  EXPECT_NE(msg.find("'" + head + "...' (10240 bytes)"), std::string::npos) << msg.substr(0, 300);
  EXPECT_NE(msg.find("not a boolean"), std::string::npos);
  // Short text is echoed as before, whole.
  expect_error("expandable_segments:yes", "yes", "not a boolean");
}

// A key one or two edits from an accepted one gets "did you mean"; a key far from all gets none.
TEST(ConfigParse, MistypedKeySuggestsTheNearestOne) {
  const std::string want =
      "cucache config: key 'expandable_segment': unknown key (did you mean "
      "'expandable_segments'?); accepted keys: max_split_size_mb, ";
  EXPECT_EQ(parse_error("expandable_segment:True").substr(0, want.size()), want);
  const struct {
    const char* text;
    const char* suggestion;
  } cases[] = {
      {"expandable_segmnets:True", "expandable_segments"},  // two letters swapped
      {"Expandable_Segments:True", "expandable_segments"},  // keys are case-sensitive
      {"max_split_size:64", "max_split_size_mb"},           // PyTorch's unit suffix left out
      {"garbage_colection_threshold:0.5", "garbage_collection_threshold"},
      {"peer_acess:none", "peer_access"},
      {"ipc_handle:True", "ipc_handles"},
      {"nvtxx:True", "nvtx"},
      {"histroy:5", "history"},
      {"per_process_memory_fractoin:0.5", "per_process_memory_fraction"},
  };
  for (const auto& c : cases) {
    const std::string msg = parse_error(c.text);
    EXPECT_NE(msg.find(std::string("(did you mean '") + c.suggestion + "'?)"), std::string::npos)
        << c.text << " -> " << msg;
    EXPECT_NE(msg.find("unknown key"), std::string::npos) << msg;
  }
  for (const char* far : {"bogus:1", "x:1", "segments:True", "expandable:True", "limit:1GiB"}) {
    const std::string msg = parse_error(far);
    EXPECT_EQ(msg.find("did you mean"), std::string::npos) << far << " -> " << msg;
    EXPECT_NE(msg.find("unknown key; accepted keys: max_split_size_mb"), std::string::npos) << msg;
  }
}

// key=value (a shell habit) instead of key:value: the suggestion is the entry with ':'.
TEST(ConfigParse, EqualsSignInsteadOfColonSuggestsTheColonForm) {
  const struct {
    const char* text;
    const char* suggestion;
  } cases[] = {
      {"expandable_segments=True", "expandable_segments:True"},
      {"max_split_size_mb = 128", "max_split_size_mb:128"},
      {"garbage_collection_threshold:0.8,expandable_segments=True", "expandable_segments:True"},
      {"trace=/tmp/a.csv", "trace:/tmp/a.csv"},
  };
  for (const auto& c : cases) {
    const std::string msg = parse_error(c.text);
    EXPECT_NE(msg.find(std::string("(did you mean '") + c.suggestion + "'?"), std::string::npos)
        << c.text << " -> " << msg;
    EXPECT_NE(msg.find("':'"), std::string::npos) << c.text << " -> " << msg;
  }
  // An unknown key with '=' gets no made-up suggestion.
  const std::string msg = parse_error("bogus=1");
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
}

TEST(ConfigParse, PyTorchOnlyKeysAreRejectedByName) {
  for (const char* key : {"backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                          "pinned_num_register_threads", "pinned_use_background_threads",
                          "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse",
                          "large_segment_size_mb"}) {
    const std::string msg = parse_error(std::string(key) + ":True");
    EXPECT_NE(msg.find(std::string("'") + key + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("a PyTorch key not supported by cucache"), std::string::npos) << msg;
  }
}

TEST(ConfigToString, DefaultIsEmpty) {
  EXPECT_EQ(to_string(config{}), "");
}

TEST(ConfigToString, WritesEveryFieldExactly) {
  config c;
  c.max_split_size = 256 * k_mib;
  c.max_non_split_rounding = 64 * k_mib;
  c.roundup_power2_divisions = divisions({{9, 4}, {1, 2}, {54, 1}});
  c.garbage_collection_threshold = 0.6;
  c.expandable_segments = true;
  c.memory_fraction = 0.75;
  c.memory_limit_bytes = std::size_t{8} << 30;
  c.trace_path = "/tmp/t.csv";
  EXPECT_EQ(to_string(c),
            "max_split_size_mb:256,max_non_split_rounding_mb:64,"
            "roundup_power2_divisions:[256:4,512:2,>:1],garbage_collection_threshold:0.6,"
            "expandable_segments:True,memory_fraction:0.75,memory_limit:8GiB,trace:/tmp/t.csv");
  EXPECT_EQ(parse_config(to_string(c)), c);
}

TEST(ConfigToString, RoundTripsParsedConfigs) {
  for (const char* text : {
           "roundup_power2_divisions:8",
           "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
           "roundup_power2_divisions:[64:4,1024:2]",
           "roundup_power2_divisions:[1:0]",
           "roundup_power2_divisions:[1:0,4:16,>:0]",
           "roundup_power2_divisions:[2:4,4:4,>:4]",
           "roundup_power2_divisions:[1:2,>:0]",
           "roundup_power2_divisions:[8796093022208:2,>:4]",
           "roundup_power2_divisions:[4096:2,8796093022208:0,>:4]",
           "garbage_collection_threshold:0.1",
           "garbage_collection_threshold:0.30000000000000004",
           "memory_fraction:1",
           "memory_limit:1",
           "memory_limit:1536KiB",
           "memory_limit:3T",
           "memory_limit:1025",
           "expandable_segments:1",
           "max_split_size_mb:17592186044415",
           "trace:C:/x y/z.csv",
       }) {
    const config c = parse_config(text);
    EXPECT_EQ(parse_config(to_string(c)), c) << text << " -> " << to_string(c);
  }
  EXPECT_EQ(to_string(parse_config("roundup_power2_divisions:[2:4,4:4,>:4]")),
            "roundup_power2_divisions:4");
  EXPECT_EQ(to_string(parse_config("roundup_power2_divisions:[64:4,1024:2]")),
            "roundup_power2_divisions:[64:4,1024:2]");
  EXPECT_EQ(to_string(parse_config("memory_limit:1536KiB")), "memory_limit:1536KiB");
  EXPECT_EQ(to_string(parse_config("memory_limit:1025")), "memory_limit:1025");
}

TEST(ConfigToString, UnrepresentableValuesThrowNamingTheKey) {
  const auto expect_throw = [](const config& c, const std::string& key) {
    try {
      (void)to_string(c);
      ADD_FAILURE() << "to_string accepted a value for " << key;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos) << e.what();
    }
  };
  config c;
  c.max_split_size = 64 * k_mib + 1;
  expect_throw(c, "max_split_size_mb");
  c = {};
  c.max_non_split_rounding = 0;
  expect_throw(c, "max_non_split_rounding_mb");
  c = {};
  c.roundup_power2_divisions = {4, 4};
  expect_throw(c, "roundup_power2_divisions");
  c = {};
  c.roundup_power2_divisions = divisions({{64, 3}});
  expect_throw(c, "roundup_power2_divisions");
  c = {};
  c.roundup_power2_divisions = divisions({{50, 2}, {14, 4}});  // entry 50 is past the last key
  expect_throw(c, "roundup_power2_divisions");
  c = {};
  c.garbage_collection_threshold = 1.5;
  expect_throw(c, "garbage_collection_threshold");
  c = {};
  c.memory_fraction = -1;
  expect_throw(c, "memory_fraction");
  c = {};
  c.trace_path = "/tmp/a,b.csv";
  expect_throw(c, "trace");
  c = {};
  c.trace_path = " lead";
  expect_throw(c, "trace");
}

TEST(ConfigFromEnv, ReadsCucacheConf) {
  ASSERT_EQ(unsetenv("CUCACHE_CONF"), 0);
  EXPECT_EQ(config_from_env(), config{});
  ASSERT_EQ(setenv("CUCACHE_CONF", "", 1), 0);
  EXPECT_EQ(config_from_env(), config{});
  ASSERT_EQ(setenv("CUCACHE_CONF", "memory_limit:2GiB,expandable_segments:True", 1), 0);
  const config c = config_from_env();
  EXPECT_EQ(c.memory_limit_bytes, std::size_t{2} << 30);
  EXPECT_TRUE(c.expandable_segments);
  ASSERT_EQ(setenv("CUCACHE_CONF", "max_split_size_mb:1", 1), 0);
  try {
    (void)config_from_env();
    ADD_FAILURE() << "config_from_env accepted max_split_size_mb:1";
  } catch (const invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("CUCACHE_CONF"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'max_split_size_mb'"), std::string::npos) << msg;
  }
  ASSERT_EQ(unsetenv("CUCACHE_CONF"), 0);
}

TEST(ConfigEntries, SplitsAsParseConfigDoes) {
  using entry = std::pair<std::string, std::string>;
  EXPECT_TRUE(config_entries("").empty());
  EXPECT_TRUE(config_entries("  ").empty());
  const auto e = config_entries(
      " max_split_size_mb : 40 ,roundup_power2_divisions:[64:8,>:1],,expandable_segments");
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0], (entry{"max_split_size_mb", "40"}));
  EXPECT_EQ(e[1], (entry{"roundup_power2_divisions", "[64:8,>:1]"}));
  EXPECT_EQ(e[2], (entry{"expandable_segments", ""}));
  // Every string to_string writes splits back into its keys.
  config c;
  c.expandable_segments = true;
  c.max_split_size = std::size_t{512} << 20;
  const auto r = config_entries(to_string(c));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].first, "max_split_size_mb");
  EXPECT_EQ(r[1].first, "expandable_segments");
  EXPECT_THROW((void)config_entries("roundup_power2_divisions:[64:8"), invalid_argument);
}

}  // namespace
}  // namespace cucache

namespace cucache {
namespace {}  // namespace
}  // namespace cucache
