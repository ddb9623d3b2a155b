// The seeded churn that tests/gpu/expandable_gpu_test.cu (ChurnKeepsEveryBlocksContents) runs on
// the H200 and tests/allocator/expandable_test.cpp (ChurnUnderALimitMovesPagesAndNeverRunsOut)
// runs on the simulated device: one script, so that the simulated run proves what the GPU run
// will do (both devices place blocks alike, page for page).
#pragma once

#include <cstddef>
#include <cstdint>

namespace cucache::test {

class churn_script {
 public:
  static constexpr int k_steps = 2000;
  static constexpr std::size_t k_max_live = 40;                      // live blocks at most
  static constexpr std::size_t k_max_bytes = std::size_t{48} << 20;  // a block's size at most

  /// One step: allocate `bytes` (to be filled with `value`), or free live block `victim`.
  struct step {
    bool allocate = false;
    std::size_t bytes = 0;
    unsigned char value = 0;
    std::size_t victim = 0;
  };

  /// The next step, with `live` blocks live now.
  step next(std::size_t live) {
    if (live < k_max_live && (draw() % 3 != 0 || live == 0)) {
      step s;
      s.allocate = true;
      s.bytes = 1 + draw() % k_max_bytes;
      s.value = static_cast<unsigned char>(1 + draw() % 250);
      return s;
    }
    step s;
    s.victim = draw() % live;
    return s;
  }

 private:
  std::uint64_t draw() {
    seed_ = seed_ * 6364136223846793005ull + 1442695040888963407ull;
    return seed_ >> 33;
  }
  std::uint64_t seed_ = 12345;
};

}  // namespace cucache::test
