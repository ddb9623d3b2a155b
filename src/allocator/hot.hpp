// CUCACHE_HOT marks the helpers of the allocation and free paths that must inline into allocate and
// deallocate (a cache-hit pair is counted in instructions: cucache-pair-count).
#pragma once

#define CUCACHE_HOT [[gnu::always_inline]] inline
