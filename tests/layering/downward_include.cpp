// Must compile: the allocator layer sees its own private headers and the core's below it. The
// control for upward_include.cpp, so that its failure is known to come from the include alone.
#include "allocator/pool_table.hpp"
#include "core/size_policy.hpp"

namespace cucache::layering_probe {
int downward_include_compiles() {
  return static_cast<int>(sizeof(detail::size_policy));
}
}  // namespace cucache::layering_probe
