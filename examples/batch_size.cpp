// Picks a training batch size from cucache's headroom: after the model's weights and optimizer
// state are allocated, max_allocatable() says how large one more request can be, now; the batch is
// the largest whose activations fit in it (with a margin), and reserve() caches that much so the
// training steps make no device allocation. Runs on a GPU, or anywhere with CUCACHE_BACKEND=sim
// (the simulated device: 80 GiB, no memory touched). With expandable segments
// (CUCACHE_CONF=expandable_segments:True) the step's many tensors share pages, so the headroom of
// one request is also the headroom of the step's working set; in the default mode it is an upper
// bound (each tensor gets its own block).
#include <cucache/cucache.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <vector>

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr std::size_t k_gib = std::size_t{1} << 30;

/// A toy model: per layer, weights and Adam's two moments (persistent), and per sample and layer
/// an activation kept for the backward pass.
struct model {
  int layers = 48;
  std::size_t weight_bytes_per_layer = 384 * k_mib;
  std::size_t activation_bytes_per_sample_per_layer = 24 * k_mib;
};

/// One forward and backward pass: every layer's activations live until the backward pass.
void train_step(const model& m, int batch) {
  std::vector<cucache::unique_device_ptr<>> activations;
  for (int l = 0; l < m.layers; ++l) {
    activations.push_back(cucache::make_unique_device<std::byte>(
        static_cast<std::size_t>(batch) * m.activation_bytes_per_sample_per_layer));
  }
  while (!activations.empty()) activations.pop_back();  // backward: freed in reverse
}

double gib(std::size_t bytes) {
  return static_cast<double>(bytes) / static_cast<double>(k_gib);
}

}  // namespace

int main() {
  try {
    const model m;
    std::vector<cucache::unique_device_ptr<>> state;  // weights, m and v
    for (int l = 0; l < m.layers; ++l) {
      for (int copy = 0; copy < 3; ++copy) {
        state.push_back(cucache::make_unique_device<std::byte>(m.weight_bytes_per_layer));
      }
    }
    const std::size_t state_bytes =
        3 * static_cast<std::size_t>(m.layers) * m.weight_bytes_per_layer;

    const std::size_t headroom = cucache::max_allocatable();
    const std::size_t per_sample =
        static_cast<std::size_t>(m.layers) * m.activation_bytes_per_sample_per_layer;
    // 10% margin for the framework's workspaces and the rounding of each tensor.
    const std::size_t usable = headroom / 10 * 9;
    const int batch = static_cast<int>(usable / per_sample);
    std::printf("model state: %.2f GiB; headroom (max_allocatable): %.2f GiB\n", gib(state_bytes),
                gib(headroom));
    std::printf("activations: %.2f GiB per sample; batch size: %d (%.2f GiB)\n", gib(per_sample),
                batch, gib(static_cast<std::size_t>(batch) * per_sample));
    if (batch < 1) {
      std::fprintf(stderr, "batch_size: not even one sample fits\n");
      return 1;
    }

    // Cache the step's working set now: the steps below then make no device allocation.
    cucache::reserve(static_cast<std::size_t>(batch) * per_sample);
    const std::uint64_t before = cucache::get().stats().device_alloc_count;
    for (int step = 0; step < 3; ++step) train_step(m, batch);
    const std::uint64_t during = cucache::get().stats().device_alloc_count - before;
    std::printf("3 training steps at batch %d: %llu device allocations\n", batch,
                static_cast<unsigned long long>(during));
    std::printf("headroom after the steps: %.2f GiB\n", gib(cucache::max_allocatable()));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "batch_size: %s\n", e.what());
    return 1;
  }
  return 0;
}
