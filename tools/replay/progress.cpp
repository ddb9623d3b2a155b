// The progress line (see progress.hpp).
#include "progress.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

namespace cucache::replay {

std::unique_ptr<progress> progress::for_terminal(std::ostream& err) {
  if (&err != &std::cerr || ::isatty(STDERR_FILENO) != 1) return nullptr;
  if (const char* off = std::getenv("CUCACHE_NO_PROGRESS"); off != nullptr && *off != '\0') {
    return nullptr;
  }
  return std::make_unique<progress>(err, std::chrono::seconds(1));
}

progress::progress(std::ostream& err, std::chrono::milliseconds delay)
    : err_(err), delay_(delay), start_(std::chrono::steady_clock::now()) {
  thread_ = std::thread([this] { loop(); });
}

progress::~progress() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  clear();
}

void progress::phase(std::string text) {
  std::lock_guard lock(mu_);
  text_ = std::move(text);
}

void progress::prefix(std::string text) {
  std::lock_guard lock(mu_);
  prefix_ = std::move(text);
}

std::string progress::prefix() const {
  std::lock_guard lock(mu_);
  return prefix_;
}

std::string progress::line() const {
  std::lock_guard lock(mu_);
  return prefix_ + text_;
}

void progress::clear() {
  std::lock_guard lock(mu_);
  if (!shown_) return;
  err_ << "\r\033[K" << std::flush;
  shown_ = false;
}

void progress::draw_locked() {
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // \r, then erase to the end of the line: the line is rewritten in place.
  err_ << fmt::format("\r\033[Kcucache-replay: {}{} ({:.0f} s)", prefix_, text_, s) << std::flush;
  shown_ = true;
}

void progress::loop() {
  std::unique_lock lock(mu_);
  if (cv_.wait_for(lock, delay_, [this] { return stop_; })) return;  // done within the delay
  while (!stop_) {
    if (!text_.empty()) draw_locked();
    cv_.wait_for(lock, std::chrono::milliseconds(250), [this] { return stop_; });
  }
}

}  // namespace cucache::replay
