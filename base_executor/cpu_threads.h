#pragma once
// [CPU threads] A CPU executor's GEMMs run on an OpenMP team of its compute thread. --threads N
// fixes the team; by default (0) each batch's team is sized from the batch's work: a thread for
// every 4 Mi multiply-adds, or for every MiB of weights the GEMM reads (a GEMM of a few rows is
// bound by reading them), at most the host's cores. So a small model's calls run on the compute
// thread alone, leaving the other cores to same-host tenants (a team of all cores between such calls
// made a tiny model's fine-tuning tenants about ten times slower: bench/scenarios/cpu_threads.json),
// and a large model's prefill or training calls still get every core.
#include <cstdint>

namespace symbiosis {

// The team for a GEMM of [rows, inner] x [inner, cols] with weights of `element_bytes` an entry,
// on a host of `cores` cores: in [1, cores].
int cpu_threads_for(int64_t rows, int64_t inner, int64_t cols, int64_t element_bytes, int cores);

}  // namespace symbiosis
