// Settings whose value, applied to the device, would silently mean something else: a memory
// fraction so small that the limit rounds to 0 bytes (which means "no limit"), a garbage-collection
// threshold whose trigger rounds to 0 (which means "off"). The allocator's constructor, where the
// device size is known, refuses them with an error naming the key and the value.
#include <gtest/gtest.h>

#include <string>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

std::string construction_error(const std::string& text, sim_options o = {}) {
  try {
    sim_allocator a(parse_config(text), o);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << text;
  return {};
}

TEST(ConfigLimits, AFractionWhoseLimitRoundsToZeroIsAnErrorNamingKeyAndValue) {
  for (const char* text : {"memory_fraction:1e-12", "per_process_memory_fraction:1e-12",
                           "memory_fraction:1e-12,memory_limit:1GiB"}) {
    SCOPED_TRACE(text);
    const std::string msg = construction_error(text);
    EXPECT_NE(msg.find("'memory_fraction'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1e-12"), std::string::npos) << msg;
    EXPECT_NE(msg.find("0 bytes"), std::string::npos) << msg;
  }
  // On a small device a larger fraction rounds to 0 as well.
  sim_options tiny;
  tiny.capacity_bytes = 1000;
  const std::string msg = construction_error("memory_fraction:0.0001", tiny);
  EXPECT_NE(msg.find("'memory_fraction'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0.0001"), std::string::npos) << msg;
}

TEST(ConfigLimits, AThresholdWhoseTriggerRoundsToZeroIsAnErrorNamingKeyAndValue) {
  for (const char* text : {"garbage_collection_threshold:1e-12",
                           "garbage_collection_threshold:1e-12,memory_limit:1GiB",
                           "garbage_collection_threshold:1e-11,memory_fraction:0.5"}) {
    SCOPED_TRACE(text);
    const std::string msg = construction_error(text);
    EXPECT_NE(msg.find("'garbage_collection_threshold'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("e-1"), std::string::npos) << msg;  // the value, as written back
    EXPECT_NE(msg.find("0 bytes"), std::string::npos) << msg;
  }
}

TEST(ConfigLimits, SmallValuesThatStillMeanACapAreHonoured) {
  {
    sim_allocator a(parse_config("memory_fraction:1e-10"));  // 8 bytes of 80 GiB: refuses all
    EXPECT_EQ(a.stats().memory_limit, 8u);
    EXPECT_THROW((void)a.alloc.allocate(512), out_of_memory);
  }
  {
    sim_allocator a(parse_config("memory_fraction:1"));
    EXPECT_EQ(a.stats().memory_limit, std::size_t{80} << 30);
  }
  {
    sim_allocator a(parse_config("garbage_collection_threshold:1e-9,memory_limit:1GiB"));
    void* p = a.alloc.allocate(3 * MiB);  // 1 byte threshold: every growth collects first
    a.alloc.deallocate(p);
    void* q = a.alloc.allocate(50 * MiB);
    EXPECT_EQ(a.stats().segment_count[0].current, 1);  // the free 20 MiB segment was collected
    a.alloc.deallocate(q);
    a.alloc.check_invariants();
  }
}

}  // namespace
}  // namespace cucache::test
