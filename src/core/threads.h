// Thread control. OpenMP owns the parallelism; OpenBLAS always runs single-threaded
// inside our fixed-size tiles, so results do not depend on the thread count.
#pragma once

namespace moe {

// n <= 0 means "all cores". Returns the count in effect.
int set_num_threads(int n);
int num_threads();

}  // namespace moe
