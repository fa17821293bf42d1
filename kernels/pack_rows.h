#pragma once
// Packing a batch on the GPU: the rows of several [tokens_i, features] tensors, concatenated
// padding-free into one [sum tokens_i, features] tensor by one kernel launch (at::cat launches
// per input and checks more). All parts must be contiguous, on one CUDA device, of one dtype.
#include <ATen/ATen.h>

#include <vector>

namespace symbiosis::kernels {

at::Tensor pack_rows(const std::vector<at::Tensor>& parts);

}  // namespace symbiosis::kernels
