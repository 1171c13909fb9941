#include "core/threads.h"

#include <cblas.h>
#include <omp.h>

namespace moe {

int set_num_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
  openblas_set_num_threads(1);
  return n;
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace moe
