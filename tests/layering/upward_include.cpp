// Must NOT compile: built with only the allocator layer's include roots, it includes a header of a
// higher layer (api/registry.hpp exists, but the api/ folder is not visible from the allocator).
// tests/CMakeLists.txt registers building it as a test that is expected to fail -- the proof that
// the build enforces the layers; downward_include.cpp is the control that does compile.
#include "allocator/pool_table.hpp"
#include "api/registry.hpp"
