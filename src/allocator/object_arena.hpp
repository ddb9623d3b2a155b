// object_arena: recycles objects of one type (blocks, segments, page mappings) without touching the
// heap in steady state.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace cucache::detail {

/// Recycles objects of one type without touching the heap in steady state. Not thread-safe:
/// each stream_pool owns one, used under the pool's mutex.
template <class T>
class object_arena {
 public:
  [[gnu::always_inline]] T* make() {
    if (free_ == nullptr) refill();
    T* t = free_;
    free_ = *reinterpret_cast<T**>(t);
    return new (t) T{};
  }
  void recycle(T* t) noexcept {
    t->~T();
    *reinterpret_cast<T**>(t) = free_;
    free_ = t;
  }

 private:
  static constexpr std::size_t k_chunk = 256;
  void refill() {
    auto& chunk = chunks_.emplace_back(std::make_unique<storage[]>(k_chunk));
    for (std::size_t i = 0; i < k_chunk; ++i) {
      T* t = reinterpret_cast<T*>(&chunk[i]);
      *reinterpret_cast<T**>(t) = free_;
      free_ = t;
    }
  }
  struct storage {
    alignas(T) unsigned char bytes[sizeof(T)];
  };
  std::vector<std::unique_ptr<storage[]>> chunks_;
  T* free_ = nullptr;
};

}  // namespace cucache::detail
