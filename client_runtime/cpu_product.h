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

namespace symbiosis::nn::detail {

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
