// The progress line of cucache-replay (issue 13, item 8): what a replay or --fit is doing, on
// stderr, rewritten in place, shown only when stderr is a terminal and only once the work has
// taken more than a second. Tests and CI (stderr a file or a pipe) never see it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace cucache::replay {

class progress {
 public:
  /// A progress line on `err` when `err` is std::cerr and stderr is a terminal (isatty), and
  /// the environment sets no CUCACHE_NO_PROGRESS; otherwise nullptr (and nothing is shown).
  [[nodiscard]] static std::unique_ptr<progress> for_terminal(std::ostream& err);
  /// Always shows (after `delay`), on `err`: for tests of the line itself.
  progress(std::ostream& err, std::chrono::milliseconds delay);
  ~progress();  // stops, and erases the line if one was shown
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;

  /// What is being done now ("gpt2_generate: run 2/5"). Thread-safe; cheap (no output here).
  void phase(std::string text);
  /// Put before every phase from now on ("trace 2 of 7: "), until set again. Thread-safe.
  void prefix(std::string text);
  [[nodiscard]] std::string prefix() const;
  /// The line as it is drawn now, without the elapsed time: prefix and phase.
  [[nodiscard]] std::string line() const;
  /// Erases the line now (before other output); later phases show it again.
  void clear();

 private:
  void loop();
  void draw_locked();
  std::ostream& err_;
  std::chrono::milliseconds delay_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mu_;  // guards prefix_, text_, shown_, stop_
  std::condition_variable cv_;
  std::string prefix_;
  std::string text_;
  bool shown_ = false;
  bool stop_ = false;
  std::thread thread_;
};

/// Tells `p`, when there is one, what is being done now.
inline void report(progress* p, std::string text) {
  if (p != nullptr) p->phase(std::move(text));
}

/// Adds to `p`'s prefix for one scope ("setting 3 of 13 (...): " after "trace 1 of 7: "), so
/// that the phases reported from inside, which replace one another, keep saying where the outer
/// loop is; the prefix before is put back on destruction. Does nothing when `p` is null.
class prefix_scope {
 public:
  explicit prefix_scope(progress* p) : p_(p), outer_(p != nullptr ? p->prefix() : std::string()) {}
  ~prefix_scope() {
    if (p_ != nullptr) p_->prefix(outer_);
  }
  prefix_scope(const prefix_scope&) = delete;
  prefix_scope& operator=(const prefix_scope&) = delete;
  void set(const std::string& text) {
    if (p_ != nullptr) p_->prefix(outer_ + text);
  }

 private:
  progress* p_;
  std::string outer_;
};

}  // namespace cucache::replay
