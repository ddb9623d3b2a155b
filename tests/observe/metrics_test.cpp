// Metrics (cucache::metrics, cucacheWriteMetrics) on the simulated device: the text is read back
// by a strict parser of Prometheus' text format 0.0.4 written here (every line a HELP, TYPE or
// sample line; HELP then TYPE then the samples of one family, never split or repeated; names and
// labels well formed, escapes undone), and every value is compared with the statistics it comes
// from: every field of the device field table (stats.hpp) per device and pool, every tag field.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/observe.hpp"
#include "cucache/stats.hpp"
#include "observe/metrics.hpp"
#include "support/sim_registry.hpp"

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

struct family {
  std::string help;
  std::string type;
  // labels as "device=0,pool=all" (sorted keys, unescaped values) -> value
  std::map<std::string, double> samples;
};

bool name_char(char c, bool first) {
  return std::isalpha(static_cast<unsigned char>(c)) != 0 || c == '_' || c == ':' ||
         (!first && std::isdigit(static_cast<unsigned char>(c)) != 0);
}

// Parses the exposition strictly; ADD_FAILURE for anything out of the format.
std::map<std::string, family> parse(const std::string& text) {
  std::map<std::string, family> out;
  std::string current;  // the family whose samples may follow
  std::set<std::string> closed;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the text must end with a line feed";
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t eol = text.find('\n', pos);
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) {
      const bool help = line[2] == 'H';
      const std::string rest = line.substr(7);
      const std::size_t sp = rest.find(' ');
      EXPECT_NE(sp, std::string::npos) << line;
      const std::string name = rest.substr(0, sp);
      for (std::size_t i = 0; i < name.size(); ++i) EXPECT_TRUE(name_char(name[i], i == 0)) << line;
      if (help) {
        EXPECT_EQ(closed.count(name), 0u) << "family split or repeated: " << name;
        EXPECT_EQ(out.count(name), 0u) << "HELP repeated: " << name;
        if (!current.empty()) closed.insert(current);
        current = name;
        out[name].help = rest.substr(sp + 1);
        EXPECT_FALSE(out[name].help.empty()) << line;
      } else {
        EXPECT_EQ(name, current) << "TYPE without its HELP just before: " << line;
        const std::string type = rest.substr(sp + 1);
        EXPECT_TRUE(type == "gauge" || type == "counter") << line;
        EXPECT_TRUE(out[name].type.empty()) << "TYPE repeated: " << line;
        EXPECT_TRUE(out[name].samples.empty()) << "TYPE after samples: " << line;
        out[name].type = type;
      }
      continue;
    }
    EXPECT_NE(line[0], '#') << "unknown comment: " << line;
    // name{label="value",...} value
    std::size_t i = 0;
    while (i < line.size() && name_char(line[i], i == 0)) ++i;
    const std::string name = line.substr(0, i);
    EXPECT_EQ(name, current) << "a sample outside its family: " << line;
    EXPECT_FALSE(out[name].type.empty()) << "a sample before TYPE: " << line;
    std::map<std::string, std::string> labels;
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const std::size_t start = i;
        while (i < line.size() && name_char(line[i], i == start)) ++i;
        const std::string key = line.substr(start, i - start);
        EXPECT_FALSE(key.empty()) << line;
        EXPECT_EQ(line.substr(i, 2), "=\"") << line;
        i += 2;
        std::string value;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            ++i;
            EXPECT_TRUE(line[i] == '\\' || line[i] == '"' || line[i] == 'n') << line;
            value += line[i] == 'n' ? '\n' : line[i];
          } else {
            value += line[i];
          }
          ++i;
        }
        EXPECT_LT(i, line.size()) << "unterminated label value: " << line;
        ++i;  // closing quote
        EXPECT_EQ(labels.count(key), 0u) << line;
        labels[key] = value;
        if (i < line.size() && line[i] == ',') ++i;
      }
      EXPECT_LT(i, line.size()) << line;
      ++i;  // '}'
    }
    EXPECT_EQ(line[i], ' ') << line;
    const std::string number = line.substr(i + 1);
    char* end = nullptr;
    const double v = std::strtod(number.c_str(), &end);
    EXPECT_TRUE(!number.empty() && *end == '\0') << "value: " << line;
    std::string key;
    for (const auto& [k, val] : labels) key += (key.empty() ? "" : ",") + k + "=" + val;
    EXPECT_EQ(out[name].samples.count(key), 0u) << "sample repeated: " << line;
    out[name].samples[key] = v;
  }
  return out;
}

class Metrics : public cucache::test::sim_registry_test {};

// Every field of the table, with the value of `s`, as the parsed families hold it for `device`.
void expect_device(const std::map<std::string, family>& fams, const cucache::device_stats& s,
                   int device) {
  using cucache::detail::metric_name;
  using cucache::detail::stat_part;
  const std::string dev = "device=" + std::to_string(device);
  const auto at = [&](const std::string& name, const std::string& labels) -> double {
    const auto f = fams.find(name);
    if (f == fams.end()) {
      ADD_FAILURE() << "no metric " << name;
      return -1;
    }
    const auto v = f->second.samples.find(labels);
    if (v == f->second.samples.end()) {
      ADD_FAILURE() << "no sample " << name << "{" << labels << "}";
      return -1;
    }
    return v->second;
  };
  cucache::for_each_stat(s, [&](const cucache::stat_field& f, const auto& value) {
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<V, cucache::stat_array>) {
      for (std::size_t pool = 0; pool < cucache::k_stat_pools; ++pool) {
        const std::string labels =
            dev + ",pool=" + std::string(cucache::k_stat_pool_names[pool]);
        EXPECT_EQ(at(metric_name(f, stat_part::current), labels), double(value[pool].current));
        EXPECT_EQ(at(metric_name(f, stat_part::peak), labels), double(value[pool].peak));
        EXPECT_EQ(at(metric_name(f, stat_part::allocated), labels), double(value[pool].allocated));
        EXPECT_EQ(at(metric_name(f, stat_part::freed), labels), double(value[pool].freed));
        EXPECT_EQ(fams.at(metric_name(f, stat_part::current)).type, "gauge");
        EXPECT_EQ(fams.at(metric_name(f, stat_part::peak)).type, "gauge");
        EXPECT_EQ(fams.at(metric_name(f, stat_part::allocated)).type, "counter");
        EXPECT_EQ(fams.at(metric_name(f, stat_part::freed)).type, "counter");
      }
    } else if constexpr (std::is_same_v<V, std::uint64_t>) {
      const double expected = f.unit == cucache::stat_unit::ns ? double(value) / 1e9
                                                               : double(value);
      EXPECT_EQ(at(metric_name(f), dev), expected) << f.name;
      EXPECT_EQ(fams.at(metric_name(f)).type,
                f.kind == cucache::stat_kind::counter ? "counter" : "gauge")
          << f.name;
    } else {
      EXPECT_EQ(at(metric_name(f), dev), value) << f.name;
      EXPECT_EQ(fams.at(metric_name(f)).type, "gauge");
    }
  });
}

TEST(MetricNames, FollowTheTableAndTheConventions) {
  using cucache::detail::metric_name;
  using cucache::detail::stat_part;
  std::set<std::string> names;
  std::size_t expected = 0;
  for (const cucache::stat_field& f : cucache::k_stat_fields) {
    if (f.shape == cucache::stat_shape::per_pool) {
      for (stat_part p : {stat_part::current, stat_part::peak, stat_part::allocated,
                          stat_part::freed}) {
        names.insert(metric_name(f, p));
      }
      expected += 4;
    } else {
      names.insert(metric_name(f));
      ++expected;
    }
  }
  EXPECT_EQ(names.size(), expected) << "two fields share a metric name";
  // A counter's family is its name without _total (OpenMetrics, prometheus_client): no other
  // metric may be called that.
  for (const std::string& n : names) {
    if (n.size() > 6 && n.substr(n.size() - 6) == "_total") {
      EXPECT_EQ(names.count(n.substr(0, n.size() - 6)), 0u) << n;
    }
  }
  EXPECT_EQ(metric_name(cucache::k_stat_fields[0]), "cucache_allocated_bytes");
  EXPECT_EQ(metric_name(cucache::k_stat_fields[0], stat_part::peak), "cucache_allocated_bytes_peak");
  EXPECT_EQ(metric_name(cucache::k_stat_fields[0], stat_part::freed),
            "cucache_allocated_bytes_freed_total");
  const auto named = [](std::string_view n) {
    for (const cucache::stat_field& f : cucache::k_stat_fields)
      if (f.name == n) return cucache::detail::metric_name(f);
    return std::string("?");
  };
  EXPECT_EQ(named("device_alloc_count"), "cucache_device_alloc_count_total");
  EXPECT_EQ(named("vm_host_ns"), "cucache_vm_host_seconds_total");
  EXPECT_EQ(named("largest_free_block"), "cucache_largest_free_block_bytes");
  EXPECT_EQ(named("free_bytes"), "cucache_free_bytes");
  EXPECT_EQ(named("events_pending"), "cucache_events_pending");
  EXPECT_EQ(named("external_fragmentation"), "cucache_external_fragmentation_ratio");
  EXPECT_EQ(cucache::detail::escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST_F(Metrics, EveryFieldOfEveryDeviceAndTagWithItsExactValue) {
  ::setenv("CUCACHE_SIM_DEVICES", "3", 1);
  cucache::detail::reset_for_testing();
  // Nothing allocated yet: every family is there with its HELP and TYPE, and no sample.
  std::map<std::string, family> fams = parse(cucache::metrics());
  EXPECT_EQ(fams.count("cucache_allocated_bytes"), 1u);
  EXPECT_TRUE(fams["cucache_allocated_bytes"].samples.empty());

  cucache::set_tag_limit(0, "kv \"cache\"\\x\nnew", 64 * k_mib);
  void* a = nullptr;
  void* b = nullptr;
  {
    cucache::scoped_tag scope("kv \"cache\"\\x\nnew");
    a = cucache::get(0).allocate(5 * k_mib);
    b = cucache::get(0).allocate(1000);
    EXPECT_THROW(static_cast<void>(cucache::get(0).allocate(64 * k_mib)),
                 cucache::tag_limit_error);
  }
  void* c = nullptr;
  {
    cucache::scoped_tag scope("train");
    c = cucache::get(2).allocate(3 * k_mib);
  }
  void* d = cucache::get(2).allocate(700);
  cucache::get(2).deallocate(d);

  const std::string text = cucache::metrics();
  fams = parse(text);
  // Devices 0 and 2 (device 1 has no allocator: nothing of it, and none was created).
  EXPECT_EQ(cucache::detail::registry::instance().find(1), nullptr);
  for (const auto& [name, f] : fams) {
    for (const auto& [labels, v] : f.samples) {
      EXPECT_EQ(labels.find("device=1"), std::string::npos) << name << " " << labels;
    }
  }
  expect_device(fams, cucache::get(0).stats(), 0);
  expect_device(fams, cucache::get(2).stats(), 2);
  // The tags, from their table.
  for (int dev : {0, 2}) {
    for (const cucache::tag_stat& t : cucache::tag_stats(dev)) {
      const std::string labels = "device=" + std::to_string(dev) + ",tag=" + t.tag;
#define CUCACHE_TAG_CHECK_(member, metric, kind, unit, help)                                   \
  if (std::string_view(#member) != "limit_bytes" || t.limit_bytes != cucache::k_no_tag_limit) { \
    EXPECT_EQ(fams[#metric].samples.at(labels), double(t.member)) << #metric << " " << labels; \
  } else {                                                                                     \
    EXPECT_EQ(fams[#metric].samples.count(labels), 0u) << #metric << " " << labels;          \
  }                                                                                            \
  EXPECT_EQ(fams[#metric].type, #kind);
      CUCACHE_TAG_STAT_FIELDS(CUCACHE_TAG_CHECK_)
#undef CUCACHE_TAG_CHECK_
    }
  }
  EXPECT_EQ(fams["cucache_tag_bytes"].samples.at("device=0,tag=kv \"cache\"\\x\nnew"),
            double(5 * k_mib + 1000));
  EXPECT_EQ(fams["cucache_tag_limit_bytes"].samples.at("device=0,tag=kv \"cache\"\\x\nnew"),
            double(64 * k_mib));
  EXPECT_EQ(fams["cucache_tag_limit_refusals_total"].samples.at(
                "device=0,tag=kv \"cache\"\\x\nnew"),
            1.0);
  EXPECT_EQ(fams["cucache_tag_bytes"].samples.at("device=2,tag=train"), double(3 * k_mib));
  EXPECT_EQ(fams["cucache_tag_limit_bytes"].samples.count("device=2,tag=train"), 0u);
  EXPECT_EQ(fams["cucache_allocation_count"].samples.at("device=2,pool=all"), 1.0);
  EXPECT_EQ(fams["cucache_allocation_count_allocated_total"].samples.at("device=2,pool=small_pool"),
            1.0);
  cucache::get(0).deallocate(a);
  cucache::get(0).deallocate(b);
  cucache::get(2).deallocate(c);
}

TEST_F(Metrics, SleepingTagsHaveTheirSleepStatistics) {
  cucache::test::use_sim_registry("expandable_segments:True");
  cucache::make_sleepable("train");
  void* p = nullptr;
  {
    cucache::scoped_tag scope("train");
    p = cucache::get(0).allocate(40 * k_mib);
  }
  std::map<std::string, family> fams = parse(cucache::metrics());
  for (const char* name : {"cucache_tag_sleeping_bytes", "cucache_tag_sleeping_host_bytes",
                           "cucache_tag_sleep_copy_seconds"}) {
    EXPECT_EQ(fams.at(name).type, "gauge");
    EXPECT_TRUE(fams.at(name).samples.empty()) << name << ": nothing sleeps yet";
  }
  cucache::sleep(0, "train", false);
  const std::vector<cucache::sleep_stat> asleep = cucache::sleeping(0);
  ASSERT_EQ(asleep.size(), 1u);
  fams = parse(cucache::metrics());
  EXPECT_EQ(fams.at("cucache_tag_sleeping_bytes").samples.at("device=0,tag=train"),
            double(asleep[0].bytes));
  EXPECT_EQ(asleep[0].bytes, 40 * k_mib);
  EXPECT_EQ(fams.at("cucache_tag_sleeping_host_bytes").samples.at("device=0,tag=train"),
            double(asleep[0].host_bytes));
  EXPECT_EQ(fams.at("cucache_tag_sleep_copy_seconds").samples.at("device=0,tag=train"),
            asleep[0].copy_seconds);
  expect_device(fams, cucache::get(0).stats(), 0);
  cucache::wake(0, "train");
  fams = parse(cucache::metrics());
  EXPECT_TRUE(fams.at("cucache_tag_sleeping_bytes").samples.empty());
  cucache::get(0).deallocate(p);
}

TEST_F(Metrics, WriteMetricsSizesCopiesAndRefusesSmallBuffers) {
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 4096), cudaSuccess);
  std::size_t needed = 0;
  ASSERT_EQ(cucacheWriteMetrics(nullptr, 0, &needed), cudaSuccess) << cucacheGetLastErrorMessage();
  const std::string text = cucache::metrics();
  EXPECT_EQ(needed, text.size() + 1);
  std::vector<char> buf(needed, 'x');
  ASSERT_EQ(cucacheWriteMetrics(buf.data(), buf.size(), &needed), cudaSuccess);
  EXPECT_EQ(std::string(buf.data()), text);
  std::vector<char> small(needed - 1, 'x');
  EXPECT_EQ(cucacheWriteMetrics(small.data(), small.size(), &needed), cudaErrorInvalidValue);
  EXPECT_EQ(small[0], '\0');
  EXPECT_EQ(needed, text.size() + 1);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("too small"), std::string::npos);
  EXPECT_EQ(cucacheWriteMetrics(buf.data(), buf.size(), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheWriteMetrics(nullptr, 10, &needed), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

}  // namespace
