// Tracing as an allocation observer (make_trace_observer in trace.hpp).
#include <memory>

#include "cucache/trace.hpp"

namespace cucache {
namespace {

class trace_observer final : public allocation_observer {
 public:
  explicit trace_observer(std::shared_ptr<trace_recorder> r) : recorder_(std::move(r)) {}

  // The recorder never throws for I/O (a failed write is reported by its next flush); a host
  // allocation failure while buffering is recorded the same way rather than failing the
  // allocation the program asked for.
  void on_allocate(const void* ptr, std::size_t requested, stream_handle stream) noexcept override {
    try {
      recorder_->record_allocate(ptr, requested, stream);
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
