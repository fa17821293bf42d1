#pragma once
// [Parts] (parts.h): the c10d process groups the parts of a sharded executor join, apart so that
// the benchmark comparing ways to split a layer (bench/shard_split.cpp) joins the same ones.
// Including this needs c10d's Gloo (USE_C10D_GLOO) and, with CUDA, NCCL (USE_C10D_NCCL)
// declarations: base_executor/CMakeLists.txt sets them for the files that do.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base_executor/parts.h"

namespace symbiosis {

struct PartGroups {
  c10::intrusive_ptr<c10d::Store> store;      // the rendezvous's TCP store
  c10::intrusive_ptr<c10d::Backend> control;  // Gloo, between the parts' CPUs
  c10::intrusive_ptr<c10d::Backend> data;     // NCCL between GPUs (device CUDA); else the Gloo group

  // Joins the other parts at options.rendezvous (blocks until all have, or throws after the
  // timeout naming the rendezvous and `name`, this part as logs call it).
  static PartGroups join(const PartOptions& options, at::Device device, const std::string& name);
};

}  // namespace symbiosis
