#include "base_executor/cpu_threads.h"

#include <algorithm>

namespace symbiosis {

// [CPU threads]
int cpu_threads_for(int64_t rows, int64_t inner, int64_t cols, int64_t element_bytes, int cores) {
  constexpr int64_t kMultiplyAddsPerThread = int64_t{4} << 20;
  constexpr int64_t kWeightBytesPerThread = int64_t{1} << 20;
  const int64_t weights = inner * cols;
  const int64_t by_work =
      std::max(rows * weights / kMultiplyAddsPerThread, weights * element_bytes / kWeightBytesPerThread);
  return static_cast<int>(std::clamp<int64_t>(by_work, 1, std::max(cores, 1)));
}

}  // namespace symbiosis
