// Test hooks of the global allocators (cucache.hpp). Not part of the supported API: tests use them
// to start each case from a fresh, empty set of allocators.
#pragma once

namespace cucache::detail {

/// Drops every global allocator and the trace recorder (flushing the trace), so that the next
/// cucache call reads CUCACHE_BACKEND and CUCACHE_CONF again and starts from nothing.
///
/// Restrictions: only for CUCACHE_BACKEND=sim -- with the cuda backend it throws std::logic_error
/// and drops nothing, since destroying allocators of a real device frees memory the program may
/// still use. No other thread may be inside a cucache call, and every pointer and device_allocator&
/// obtained before is dangling afterwards. Harmless when nothing has been created yet (any
/// backend, even an unparsable environment).
void reset_for_testing();

}  // namespace cucache::detail
