// The control of the layering test allocator_impl_stays_private: a file of another layer that
// includes the allocator's internals, which cmake/check_impl_includes.cmake must refuse. Never
// compiled.
#include "allocator/allocator_impl.hpp"
