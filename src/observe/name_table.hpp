// Names interned as small ids (1, 2, ...), for the life of the process: the library's tags
// (observe_hub.cpp) and the tags of the traces it reads (trace_reader.cpp) each keep one. Never
// destroyed (make one with `new` and keep it): ids and the names' storage stay valid while threads
// may still hold them during static destruction. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "backend/thread_annotations.hpp"

namespace cucache::detail {

class name_table {
 public:
  /// The id of `name` (not empty), interned.
  std::uint32_t intern(std::string_view name) {
    detail::lock_guard lock(mu_);
    if (auto it = ids_.find(name); it != ids_.end()) return it->second;
    names_.emplace_back(name);
    const auto id = static_cast<std::uint32_t>(names_.size());
    ids_.emplace(names_.back(), id);
    return id;
  }
  /// The id of `name` if it was ever interned, else 0.
  std::uint32_t find(std::string_view name) {
    detail::lock_guard lock(mu_);
    auto it = ids_.find(name);
    return it == ids_.end() ? 0 : it->second;
  }
  /// The name of `id`; "" for 0 or an id never given. The view stays valid for good (a deque
  /// keeps its elements in place as it grows).
  std::string_view name(std::uint32_t id) {
    detail::lock_guard lock(mu_);
    return id == 0 || id > names_.size() ? std::string_view() : std::string_view(names_[id - 1]);
  }

 private:
  mutex mu_;
  std::deque<std::string> names_ GUARDED_BY(mu_);  // id - 1 -> name
  std::unordered_map<std::string_view, std::uint32_t> ids_ GUARDED_BY(mu_);
};

}  // namespace cucache::detail
