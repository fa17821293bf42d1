#pragma once
// [CPU decode product] x·Wᵀ for the few rows of a decode step (one token a sequence) against a
// large bf16 weight on the CPU: the lm_head's vocabulary (32 000 x 4 096 in Llama-2-7B, 262 MB read
// a token) in [Host decode] (client_runtime/inference/heterogeneous.h), and a monolithic CPU model's
// base layers. Such a product is a pass over the weight, so what counts is the rate it reads it:
// LibTorch's bf16 product (oneDNN) read the lm_head at 8-11 GB/s on this 2-core machine, where a sum
// reads 26-33 GB/s. Here each row of W is read once for all the rows of x, converted to fp32 in
// registers, the products summed in fp32 and rounded to bf16 once, as LibTorch's bf16 product
// computes (its sums in another order); the rows of W are split over LibTorch's threads. AVX-512
// intrinsics where the cores have them (checked once at run time), elsewhere loops over blocks of 16
// floats that the compiler vectorizes (compiled for AVX2 and plain x86-64, chosen when loaded).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace symbiosis::nn::detail {

// [Balanced tasks] Runs tasks 0 .. count-1 on LibTorch's threads (at least min_per_thread tasks a
// thread): each thread first takes the tasks of its own equal, contiguous part in order (the static
// split, so a thread reads the memory it first touched: [CPU decode attention]'s cache), then takes
// what is left of the other parts. A static split alone waits for its slowest thread: one whose core
// is lent to another process (the executor, another tenant, a build) holds up the whole call by
// its whole part, and two threads on two busy cores read the cache at half the rate of one
// (measured on this 2-core VM during a build: 7-8 GB/s against 14-18 on one thread). Here it
// holds it up by the task it is in. make_worker() is called once a thread and returns what runs a
// task, worker(i), with its own scratch.
template <typename MakeWorker>
void balanced_tasks(int64_t count, int64_t min_per_thread, const MakeWorker& make_worker) {
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count / std::max<int64_t>(1, min_per_thread)));
  if (threads == 1 || at::in_parallel_region()) {
    auto worker = make_worker();
    for (int64_t i = 0; i < count; ++i) worker(i);
    return;
  }
  struct alignas(64) Part {  // a cache line each: the threads take from them at once
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::vector<Part> parts(static_cast<size_t>(threads));
  for (int64_t w = 0; w < threads; ++w) {
    parts[w].next.store(w * count / threads, std::memory_order_relaxed);
    parts[w].end = (w + 1) * count / threads;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      auto worker = make_worker();
      for (int64_t k = 0; k < threads; ++k) {
        auto& part = parts[(w + k) % threads];
        for (int64_t i = part.next.fetch_add(1, std::memory_order_relaxed); i < part.end;
             i = part.next.fetch_add(1, std::memory_order_relaxed)) {
          worker(i);
        }
      }
    }
  });
}

// Whether cpu_decode_product takes x [..., in] and weight [out, in]: both bf16 on the CPU, weight
// contiguous, in a multiple of 16, at most kCpuDecodeProductRows rows of x, nothing to differentiate
// (grad mode off, or neither requires a gradient).
constexpr int64_t kCpuDecodeProductRows = 16;
bool cpu_decode_product_supports(const at::Tensor& x, const at::Tensor& weight);

// x·weightᵀ [..., out] in bf16; see [CPU decode product]. Throws unless cpu_decode_product_supports.
at::Tensor cpu_decode_product(const at::Tensor& x, const at::Tensor& weight);

// x·weightᵀ: cpu_decode_product where it applies, at::linear otherwise.
at::Tensor linear_no_bias(const at::Tensor& x, const at::Tensor& weight);

}  // namespace symbiosis::nn::detail
