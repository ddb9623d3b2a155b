// sparse_page_table: a table indexed by the pages of one range (core/vm_range.hpp) that holds
// storage only where entries are set, for the page table's mappings and edge counts and the idle
// runs' index (core/run_index.hpp).
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <vector>

namespace cucache::detail {

/// A table indexed by page that holds storage only for the chunks of 512 pages in which some
/// entry differs from T{}; an entry read where no chunk is allocated is T{}. O(1) access.
template <class T>
class sparse_page_table {
 public:
  static constexpr std::size_t k_chunk = 512;
  explicit sparse_page_table(std::size_t pages = 0) : dir_((pages + k_chunk - 1) / k_chunk) {}
  [[nodiscard]] T get(std::size_t pg) const noexcept {
    const chunk* c = dir_[pg / k_chunk].get();
    return c != nullptr ? c->v[pg % k_chunk] : T{};
  }
  /// Sets the entry of pg to v (T{} erases it). Inline, with the allocation and the freeing of
  /// a chunk out of line: the pager sets two edge counts at every carve and free
  /// (cucache-pair-count). An emptied chunk stays where it is as the one spare, so that a block
  /// carved and freed alone in its chunk in a loop neither allocates nor calls anything; when
  /// another chunk empties or needs storage, the spare moves there or is freed.
  [[gnu::always_inline]] void set(std::size_t pg, const T& v) {
    const std::size_t i = pg / k_chunk;
    chunk* c = dir_[i].get();
    const bool empty = v == T{};
    if (c == nullptr) [[unlikely]] {
      if (empty) return;
      c = make_chunk(i);
    }
    T& slot = c->v[pg % k_chunk];
    const bool was_empty = slot == T{};
    slot = v;
    if (was_empty == empty) return;
    if (!empty) {
      ++c->used;
    } else if (--c->used == 0 && i != spare_at_) [[unlikely]] {
      keep_as_spare(i);
    }
  }
  /// Chunks allocated now, the spare included (host memory: chunks x sizeof(T) x 512).
  [[nodiscard]] std::size_t chunks() const noexcept {
    std::size_t n = 0;
    for (const auto& c : dir_) n += c != nullptr;
    return n;
  }
  /// f(page, entry) for every entry that is not T{}, in page order.
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i < dir_.size(); ++i) {
      if (dir_[i] == nullptr || dir_[i]->used == 0) continue;
      for (std::size_t j = 0; j < k_chunk; ++j) {
        if (!(dir_[i]->v[j] == T{})) f(i * k_chunk + j, dir_[i]->v[j]);
      }
    }
  }

 private:
  struct chunk {
    std::array<T, k_chunk> v{};
    std::size_t used = 0;  // entries that are not T{}
  };
  std::vector<std::unique_ptr<chunk>> dir_;
  static constexpr std::size_t k_no_spare = ~std::size_t{0};
  /// The chunk of dir_ that emptied last, left in place (the one spare), or k_no_spare. It may
  /// have been filled again since: a spare is one whose `used` is 0.
  std::size_t spare_at_ = k_no_spare;

  [[nodiscard]] chunk* spare() const noexcept {
    if (spare_at_ == k_no_spare) return nullptr;
    chunk* c = dir_[spare_at_].get();
    return c != nullptr && c->used == 0 ? c : nullptr;
  }
  /// dir_[i], empty until now, gets a chunk: the spare, moved, else a new one.
  [[gnu::noinline]] chunk* make_chunk(std::size_t i) {
    dir_[i] = spare() != nullptr ? std::move(dir_[spare_at_]) : std::make_unique<chunk>();
    spare_at_ = k_no_spare;
    return dir_[i].get();
  }
  /// dir_[i] emptied: it becomes the spare; an earlier spare still empty is freed.
  [[gnu::noinline]] void keep_as_spare(std::size_t i) noexcept {
    if (spare() != nullptr) dir_[spare_at_].reset();
    spare_at_ = i;
  }
};

}  // namespace cucache::detail
