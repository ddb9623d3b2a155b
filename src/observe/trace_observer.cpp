// Tracing as an allocation observer (make_trace_observer in trace.hpp).
#include <memory>

#include "cucache/trace.hpp"
#include "observe/observe_hub.hpp"

namespace cucache {
namespace {

/// The name of the calling thread's current tag (empty: none), for the Tag column. Names never
/// change once interned, so the last one is kept per thread: the tag table's lock is taken only
/// when the thread's tag changes.
std::string_view current_tag_name() {
  thread_local std::uint32_t cached_id = 0;
  thread_local std::string cached_name;
  const std::uint32_t id = detail::current_tag_id();
  if (id == 0) return {};
  if (id != cached_id) {
    cached_name = detail::tag_name(id);
    cached_id = id;
  }
  return cached_name;
}

class trace_observer final : public allocation_observer {
 public:
  explicit trace_observer(std::shared_ptr<trace_recorder> r) : recorder_(std::move(r)) {}

  // The recorder never throws for I/O (a failed write is reported by its next flush); a host
  // allocation failure while buffering is recorded the same way rather than failing the
  // allocation the program asked for.
  void on_allocate(const void* ptr, std::size_t requested, stream_handle stream) noexcept override {
    try {
      recorder_->record_allocate(ptr, requested, stream, current_tag_name());
    } catch (...) {
      recorder_->note_lost_row();
    }
  }
  void on_free(const void* ptr, std::size_t requested, stream_handle stream) noexcept override {
    try {
      recorder_->record_free(ptr, requested, stream);
    } catch (...) {
      recorder_->note_lost_row();
    }
  }
  void on_failure(std::size_t requested, stream_handle stream) noexcept override {
    try {
      recorder_->record_failure(requested, stream);
    } catch (...) {
      recorder_->note_lost_row();
    }
  }

 private:
  std::shared_ptr<trace_recorder> recorder_;
};

}  // namespace

std::shared_ptr<allocation_observer> make_trace_observer(std::shared_ptr<trace_recorder> recorder) {
  return std::make_shared<trace_observer>(std::move(recorder));
}

}  // namespace cucache
