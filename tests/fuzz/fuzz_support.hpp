// What the fuzz harnesses share: a reader that turns the fuzzer's bytes into values (running out
// of bytes yields zeros, so every input is a valid program), a check that aborts -- the fuzzer's
// notion of a bug -- with a message, and per-class execution counters printed at exit when
// CUCACHE_FUZZ_STATS is set (the counts the CI log and docs/testing.md report).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace cucache::fuzz {

class byte_reader {
 public:
  byte_reader(const std::uint8_t* data, std::size_t size) : p_(data), n_(size) {}
  [[nodiscard]] bool empty() const noexcept { return n_ == 0; }
  [[nodiscard]] std::size_t left() const noexcept { return n_; }
  std::uint8_t u8() noexcept {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  std::uint16_t u16() noexcept { return static_cast<std::uint16_t>(u8() | (u8() << 8)); }
  std::uint64_t u64() noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{u8()} << (8 * i);
    return v;
  }
  /// The rest of the input as text.
  std::string_view rest() noexcept {
    std::string_view s(reinterpret_cast<const char*>(p_), n_);
    p_ += n_;
    n_ = 0;
    return s;
  }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
};

[[noreturn]] inline void fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "cucache fuzz check failed: %s (%s:%d)\n", what, file, line);
  std::abort();
}
#define CUCACHE_FUZZ_CHECK(cond) \
  ((cond) ? (void)0 : ::cucache::fuzz::fail(#cond, __FILE__, __LINE__))

/// Named execution counters, printed at exit when CUCACHE_FUZZ_STATS is set.
template <std::size_t N>
class counters {
 public:
  explicit counters(const std::array<const char*, N>& names) : names_(names) {}
  ~counters() {
    if (std::getenv("CUCACHE_FUZZ_STATS") == nullptr) return;
    for (std::size_t i = 0; i < N; ++i) {
      std::fprintf(stderr, "cucache-fuzz-count %-28s %llu\n", names_[i],
                   static_cast<unsigned long long>(count_[i].load()));
    }
  }
  void add(std::size_t i) noexcept { count_[i].fetch_add(1, std::memory_order_relaxed); }

 private:
  std::array<const char*, N> names_;
  std::array<std::atomic<std::uint64_t>, N> count_{};
};

}  // namespace cucache::fuzz
