#pragma once
// Heterogeneous placement of one tenant's generation: prefill on a GPU, the KV cache in host memory,
// decode on the CPU (the paper's §3.4 and §4.3.2).
//
// [Host decode] A tenant whose context does not fit a GPU's memory (a 64K-token prompt of a 7B
// model holds a 32 GB KV cache) prefills where compute is plentiful and decodes where memory is:
//  1. the prompt runs through the client's layers on the prefill device (a GPU), and each layer's
//     keys and values go to host memory (page-locked) as the layer produces them
//     ([Offloaded prefill] in models/kv_cache.h): the GPU never holds more than one layer's;
//  2. every decode step then runs the client's layers on the CPU, a copy of the same model and
//     adapter, attending over the cache where it lies; its base-layer calls go through a client of
//     its own (device "cpu": the same-host shared-memory transport, or TCP from another host), or
//     are computed in-process when the model is monolithic.
// The switch happens inside one request ([Continuous batching] in generator.h: a request's prefill
// step gives its first token, and its later tokens come from decode steps), so the caller sees an
// ordinary Generator. The cache is allocated once in host memory for max_sequences x max_tokens,
// checked against GeneratorOptions::host_cache_capacity_bytes.
//
// The CPU copy's adapter is kept equal to the prefill model's by an AdapterMirror, refreshed at each
// step: a tenant that trains the adapter between steps decodes with what it trained, and a step
// with an unchanged adapter copies nothing.
//
// Usage (the decode side's model comes from the same checkpoint and carries the same adapter kind):
//   auto gpu_lm = open_causal_lm(*checkpoint, gpu_client, {.dtype = at::kBFloat16, .device = at::kCUDA});
//   auto cpu_lm = open_causal_lm(*checkpoint, cpu_client, {.dtype = at::kBFloat16, .device = at::kCPU});
//   load_peft_adapter(*gpu_lm.module, dir);  load_peft_adapter(*cpu_lm.module, dir);
//   Generator generator(gpu_lm, cpu_lm, {.max_tokens = 65536, .host_cache_capacity_bytes = 100LL << 30});
#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace symbiosis {

// Keeps the trainable parameters of `mirror` (the CPU copy) equal to those of `source` (the model
// the tenant trains), matched by name. Construction checks both have the same trainable parameters
// (names, shapes) and copies them all; refresh() copies those modified since (by the tensors'
// version counters, which every in-place update, an optimizer step's included, increments).
// Both modules must outlive the mirror. Not thread-safe: call from the generation loop.
class AdapterMirror {
 public:
  AdapterMirror(torch::nn::Module& source, torch::nn::Module& mirror);
  AdapterMirror(const AdapterMirror&) = delete;
  AdapterMirror& operator=(const AdapterMirror&) = delete;
  // Copies the parameters changed since the last copy; returns how many it copied.
  int64_t refresh();
  int64_t parameters() const { return static_cast<int64_t>(pairs_.size()); }

 private:
  struct Pair {
    std::string name;
    at::Tensor source, mirror;
    int64_t copied_version = 0;  // source's version when last copied
  };
  std::vector<Pair> pairs_;
};

}  // namespace symbiosis
