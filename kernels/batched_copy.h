#pragma once
// Packing and unpacking a batch on the GPU in one kernel launch. A batch concatenates the rows of
// several requests' [tokens_i, features] tensors, padding-free, into one [sum tokens_i, features]
// tensor, and its result is split back the same way: both are a set of copies between pairs of
// equally sized tensors, which copy_tensors does in one launch whatever the number of requests
// (at::cat and per-request copies launch once per request). The tensors may live in different
// allocations, other processes' CUDA IPC buffers included. Built only with CUDA.
#include <ATen/ATen.h>

#include <vector>

namespace symbiosis::kernels {

// destinations[i] = sources[i] for every i, on the current CUDA stream. Each pair: contiguous,
// CUDA, same device, same number of bytes.
void copy_tensors(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& destinations);

}  // namespace symbiosis::kernels
