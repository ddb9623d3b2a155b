// The held block's settling (pool_mutex.hpp): what every lock but the fast paths' runs when the
// pool's last free left its block unmerged (defer_coalescing:True).
#include "allocator/stream_pool.hpp"

#include "allocator/pager.hpp"

namespace cucache::detail {

void settle_held_block(block* b) noexcept {
  stream_pool& p = *b->seg->owner;
  p.mu.assert_held();  // the lock that settles (pool_mutex::lock, try_lock, settle_held)
  // Expandable mode: the free's page step, deferred with it (pager::hold_pages).
  if (b->seg->vm != nullptr) p.pages.holder()->settle_pages(p, b);
  p.coalesce(b);
}

}  // namespace cucache::detail
