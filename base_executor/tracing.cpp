#include "base_executor/tracing.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <filesystem>
#include <fstream>

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

namespace symbiosis {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

void Tracer::start(const std::string& path, bool cuda, uint64_t batches_so_far) {
  TORCH_CHECK(!active(), "a trace is running already (to be written to ", path_, "); stop it first");
  TORCH_CHECK(!path.empty(), "a trace's path is required (the file the executor writes, on its host)");
  // Refused now rather than after the traced work: the file must be writable.
  TORCH_CHECK(std::ofstream(path).good(), "cannot write the trace file ", path, " on the executor's host");
  std::filesystem::remove(path);
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> activities = {ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  path_ = path;
  first_batch_ = batches_so_far;
  spdlog::info("tracing, to {}", path_);
}

uint64_t Tracer::stop(uint64_t batches_so_far) {
  TORCH_CHECK(active(), "no trace is running (start one first)");
  const std::string path = std::exchange(path_, "");
  profiler::disableProfiler()->save(path);
  TORCH_CHECK(std::filesystem::exists(path), "the profiler wrote no trace to ", path);
  spdlog::info("wrote the trace of {} batches to {}", batches_so_far - first_batch_, path);
  return batches_so_far - first_batch_;
}

const char* layer_op_name(LayerOp op) {
  switch (op) {
    case LayerOp::kForward: return "forward";
    case LayerOp::kBackwardInput: return "backward";
    case LayerOp::kForwardNoBias: return "forward_no_bias";
  }
  return "?";
}

std::string batch_scope_name(const CallBatcher::Batch& batch, const std::string& layer_name) {
  std::string name =
      "symbiosis::batch " + layer_name + " " + layer_op_name(batch.op) + " " + std::to_string(batch.tokens) + "t";
  for (const auto& r : batch.requests) {
    name += " c" + std::to_string(r.client_id) + ":r" + std::to_string(r.payload.header.request_id);
  }
  return name;
}

}  // namespace symbiosis
