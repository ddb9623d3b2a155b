// Compiled as C++17 by ctest cxx17_include_names_cxx20, which expects it to fail with
// cucache.hpp's #error naming the C++20 requirement (not an error deep inside config.hpp).
#include <cucache/cucache.hpp>

int main() {
  return 0;
}
