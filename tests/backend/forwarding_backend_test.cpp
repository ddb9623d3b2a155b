// Tests of forwarding_backend (include/cucache/forwarding_backend.hpp): every call of the table of
// device_backend's virtuals reaches the wrapped backend, the table names every virtual of
// device_backend (from the vtable layout of the Itanium C++ ABI: a virtual added to backend.hpp
// and not to the table fails here), and a wrapper that overrides one call keeps the others.
#include "cucache/forwarding_backend.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backend/call_probe.hpp"
#include "cucache/sim_backend.hpp"

namespace cucache {
namespace {

TEST(ForwardingBackend, ForwardsEveryCallOfTheTable) {
  auto probe = std::make_shared<test::call_probe>();
  forwarding_backend f(probe);
  EXPECT_EQ(test::calls_not_forwarded(f, *probe), std::vector<std::string>{});
}

// The vtable slot a pointer to a virtual member function names (Itanium C++ ABI: {ptr, adj}; on
// x86-64 ptr is 1 + the slot's byte offset; on ARM ptr is the offset and adj's low bit says
// "virtual"); nullopt for a non-virtual function.
struct member_pointer_repr {
  std::uintptr_t ptr;
  std::ptrdiff_t adj;
};
template <class PM>
std::optional<std::size_t> vtable_slot(PM pm) {
  static_assert(sizeof(PM) == sizeof(member_pointer_repr));
  member_pointer_repr r{};
  std::memcpy(&r, &pm, sizeof r);
#if defined(__arm__) || defined(__aarch64__)
  if ((r.adj & 1) == 0) return std::nullopt;
  return r.ptr / sizeof(void*);
#else
  if ((r.ptr & 1) == 0) return std::nullopt;
  return (r.ptr - 1) / sizeof(void*);
#endif
}

// A class's first new virtual takes the slot after all of its primary base's: its slot is the
// number of slots of device_backend's vtable (two of them the destructor's: complete, deleting).
struct one_past_device_backend : device_backend {
  virtual void sentinel() {}
};

TEST(ForwardingBackend, TableNamesEveryVirtualOfDeviceBackend) {
#if !defined(__GXX_ABI_VERSION)
  GTEST_SKIP()
      << "reads the vtable layout of the Itanium C++ ABI, which this compiler does not use";
#else
  const std::optional<std::size_t> end = vtable_slot(&one_past_device_backend::sentinel);
  ASSERT_TRUE(end.has_value());
  constexpr std::size_t k_destructor_slots = 2;
  std::set<std::size_t> slots;
  std::vector<std::string> not_virtual;
#define CUCACHE_SLOT_OF(ret, fn, params, args, quals)                           \
  if (const auto s = vtable_slot(&device_backend::fn)) {                        \
    EXPECT_LT(*s, *end) << #fn;                                                 \
    EXPECT_TRUE(slots.insert(*s).second) << #fn << " named twice in the table"; \
  } else {                                                                      \
    not_virtual.emplace_back(#fn);                                              \
  }
  CUCACHE_DEVICE_BACKEND_CALLS(CUCACHE_SLOT_OF)
#undef CUCACHE_SLOT_OF
  EXPECT_EQ(not_virtual, std::vector<std::string>{});
  EXPECT_EQ(slots.size() + k_destructor_slots, *end)
      << "device_backend has " << *end - k_destructor_slots << " virtual functions besides its "
      << "destructor and CUCACHE_DEVICE_BACKEND_CALLS (include/cucache/forwarding_backend.hpp) "
      << "names " << slots.size() << ": add the missing ones to the table, so that every wrapper "
      << "forwards them";
#endif
}

// A wrapper overrides one call; the others still reach the real device. The optional calls a
// hand-written wrapper used to drop (peer access, IPC export) are forwarded to a sim_backend with
// two devices, so their effect is visible.
class counting_mallocs final : public forwarding_backend {
 public:
  using forwarding_backend::forwarding_backend;
  void* segment_malloc(std::size_t bytes) override {
    ++mallocs;
    return forwarding_backend::segment_malloc(bytes);
  }
  int mallocs = 0;
};

TEST(ForwardingBackend, AWrapperOverridesOnlyWhatItChanges) {
  sim_options o;
  o.device_count = 2;
  auto sim = std::make_shared<sim_backend>(o);
  counting_mallocs w(sim);
  void* p = w.segment_malloc(std::size_t{2} << 20);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(w.mallocs, 1);
  EXPECT_EQ(sim->calls(sim_call::segment_malloc), 1u);
  w.configure_peer_access(peer_access_mode::all);
  EXPECT_EQ(w.access_devices(), (std::vector<int>{0, 1}));
  w.configure_peer_access(peer_access_mode::none);
  EXPECT_EQ(w.access_devices(), std::vector<int>{0});
  w.enable_phys_export();  // the default body would throw "cannot share memory" (code 801)
  const segment_ipc_handle h = w.segment_export(p);
  EXPECT_EQ(sim->calls(sim_call::segment_export), 1u);
  static_cast<void>(h);
  w.segment_free(p);
  EXPECT_EQ(&w.inner(), sim.get());
}

}  // namespace
}  // namespace cucache
