#include "core/threads.h"

#include <cblas.h>
#include <fmt/ostream.h>
#include <omp.h>

#include <ostream>

#include "core/error.h"

namespace moe {

int set_num_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
  openblas_set_num_threads(1);
  return n;
}

int num_threads() { return omp_get_max_threads(); }

int available_cores() { return omp_get_num_procs(); }

void check_thread_count(int64_t requested, std::string_view name) {
  if (requested < 0 || requested > kMaxThreads)
    MOE_CONFIG_ERROR("{} must be between 0 (all cores) and {}, got {}", name, kMaxThreads, requested);
}

int threads_in_effect(int64_t requested, std::string_view name, std::ostream& warnings) {
  check_thread_count(requested, name);
  const int cores = available_cores();
  if (requested == 0) return cores;
  if (requested > cores) {
    fmt::print(warnings, "warning: {} = {} is more than the {} cores; using {}\n", name, requested, cores, cores);
    return cores;
  }
  return static_cast<int>(requested);
}

}  // namespace moe
