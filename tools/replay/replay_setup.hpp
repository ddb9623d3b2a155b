// What every pass over a trace sets up the same way -- the replay's timed runs, the fit's
// bisection, the timeline's recording pass: the backend, the effective config and the streams.
// One definition (replay_engine.cpp), so that a timeline page shows exactly the replay's run.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cucache/backend.hpp"
#include "cucache/config.hpp"
#include "peers.hpp"
#include "replay_engine.hpp"

namespace cucache::replay {

/// The backend of one replay, on device 0: the simulated device with --capacity-gib as its
/// capacity (events complete at once: a replay runs no kernels), or the GPU.
[[nodiscard]] std::shared_ptr<device_backend> backend_for(const options& opts);

/// opts.cfg, with --capacity-gib folded into the memory limit on a GPU.
[[nodiscard]] config effective_config(const options& opts);

/// The streams of one trace's replays: on the simulated device the trace's own ids (it takes any
/// handle, and distinct ids keep the pools apart), on a GPU one CUDA stream per id.
class replay_streams {
 public:
  replay_streams(const prepared_trace& trace, backend_kind kind);
  [[nodiscard]] std::span<const stream_handle> handles() const noexcept;

 private:
  std::optional<cuda_stream_table> cuda_;
  std::vector<stream_handle> sim_;
};

}  // namespace cucache::replay
