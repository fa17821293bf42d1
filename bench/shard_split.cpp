// symbiosis-bench-shard-split: how a sharded executor should split a base layer ([Parts] in
// base_executor/parts.h; docs/sharding.md). For per-layer calls of T tokens against one layer of
// [out, in], over N parts joined as the executor's are (c10d: Gloo on CPU, NCCL on GPUs), it times
//   one device:      the whole weight on one device, x · Wᵀ there (no communication);
//   tensor-parallel: the caller's part broadcasts x, each part multiplies it by its rows of W, and
//                    the caller gathers the columns (forward) or sums the parts (backward-input);
//   FSDP-style:      every part all-gathers the layer's weight from the parts' shards, and the
//                    caller multiplies by the whole of it (as FSDP does before each layer).
// Rank 0 prints one line per shape, op and T (milliseconds a call, medians), and writes --out.
// Started once, it starts its N - 1 other ranks itself.
#include <CLI/CLI.hpp>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base_executor/part_groups.h"
#include "common/checkpoint.h"
#include "common/cuda.h"

namespace {

using namespace symbiosis;
using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t out = 0, in = 0;
};

std::vector<Shape> parse_shapes(const std::string& text) {
  std::vector<Shape> shapes;
  std::stringstream all(text);
  for (std::string shape; std::getline(all, shape, ',');) {
    const auto x = shape.find('x');
    shapes.push_back({std::stoll(shape.substr(0, x)), std::stoll(shape.substr(x + 1))});
  }
  return shapes;
}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream all(text);
  for (std::string value; std::getline(all, value, ',');) values.push_back(std::stoll(value));
  return values;
}

void finish(const c10::intrusive_ptr<c10d::Work>& work) { work->wait(); }

class Bench {
 public:
  Bench(PartGroups groups, int rank, int parts, at::Device device, at::ScalarType dtype, int iterations)
      : groups_(std::move(groups)),
        rank_(rank),
        parts_(parts),
        device_(device),
        iterations_(iterations),
        options_(at::TensorOptions().dtype(dtype).device(device)) {}

  // Median milliseconds of `call` at rank 0 (every rank runs it; they start each one together).
  double time(const std::function<void()>& call) {
    std::vector<double> ms;
    for (int i = -2; i < iterations_; ++i) {  // two warm-up calls
      barrier();
      const auto started = Clock::now();
      call();
      sync();
      if (i >= 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - started).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  nlohmann::json measure(const Shape& shape, int64_t tokens, bool backward) {
    const int64_t rows = shape.out / parts_;  // each part's rows of W (the shapes divide evenly)
    auto share = at::randn({rows, shape.in}, options_) * 0.02;
    const int64_t in = backward ? shape.out : shape.in;
    auto x = at::randn({tokens, in}, options_);
    nlohmann::json row = {
        {"out", shape.out}, {"in", shape.in}, {"tokens", tokens}, {"op", backward ? "backward" : "forward"}};
    // One device: the whole weight at rank 0.
    at::Tensor whole = rank_ == 0 ? at::randn({shape.out, shape.in}, options_) * 0.02 : at::Tensor();
    row["one_device_ms"] = time([&] {
      if (rank_ == 0) backward ? at::mm(x, whole) : at::mm(x, whole.t());
    });
    whole = at::Tensor();
    // Tensor-parallel.
    row["tensor_parallel_ms"] = time([&] {
      std::vector<at::Tensor> input{x};
      c10d::BroadcastOptions from_caller;
      finish(groups_.data->broadcast(input, from_caller));
      if (backward) {
        std::vector<at::Tensor> part{at::mm(x.narrow(1, rank_ * rows, rows), share)};
        c10d::ReduceOptions to_caller;
        finish(groups_.data->reduce(part, to_caller));
      } else {
        std::vector<at::Tensor> part{at::mm(x, share.t())};
        std::vector<std::vector<at::Tensor>> gathered(rank_ == 0 ? 1 : 0);
        if (rank_ == 0) {
          for (int p = 0; p < parts_; ++p) gathered[0].push_back(at::empty({tokens, rows}, options_));
        }
        c10d::GatherOptions to_caller;
        finish(groups_.data->gather(gathered, part, to_caller));
        if (rank_ == 0) at::cat(gathered[0], 1);
      }
    });
    // FSDP-style.
    auto gathered_weight = at::empty({shape.out, shape.in}, options_);
    row["fsdp_ms"] = time([&] {
      std::vector<at::Tensor> shards;
      for (int p = 0; p < parts_; ++p) shards.push_back(gathered_weight.narrow(0, p * rows, rows));
      std::vector<std::vector<at::Tensor>> output{shards};
      std::vector<at::Tensor> input{share};
      finish(groups_.data->allgather(output, input));
      if (rank_ == 0) backward ? at::mm(x, gathered_weight) : at::mm(x, gathered_weight.t());
    });
    row["fsdp_over_tensor_parallel"] = row["fsdp_ms"].get<double>() / row["tensor_parallel_ms"].get<double>();
    return row;
  }

 private:
  void barrier() {
    std::vector<at::Tensor> one{at::ones({1}, at::kFloat)};
    finish(groups_.control->allreduce(one));
  }
  void sync() {
#ifdef SYMBIOSIS_WITH_CUDA
    if (device_.is_cuda()) cuda::synchronize_stream(cuda::current_stream(device_.index()));
#endif
  }

  PartGroups groups_;
  int rank_, parts_;
  at::Device device_;
  int iterations_;
  at::TensorOptions options_;
};

}  // namespace

int main(int argc, char** argv) {
  int parts = 2, rank = -1, iterations = 20;
  std::string device_kind = "cpu", dtype_name = "fp32", shapes_text = "4096x4096", tokens_text = "1,16,128,1024",
              rendezvous, out;
  CLI::App app{"symbiosis-bench-shard-split: tensor-parallel against FSDP-style per-layer calls over N parts"};
  app.add_option("--parts", parts, "parts (processes; on GPUs one each, cuda:0 to cuda:N-1)")->capture_default_str();
  app.add_option("--device", device_kind, "cpu (Gloo) or cuda (NCCL)")->capture_default_str();
  app.add_option("--dtype", dtype_name, "fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--shapes", shapes_text, "layers as OUTxIN, comma-separated (OUT divisible by --parts)")
      ->capture_default_str();
  app.add_option("--tokens", tokens_text, "tokens a call, comma-separated")->capture_default_str();
  app.add_option("--iterations", iterations, "timed calls of each kind (after two warm-up calls)")
      ->capture_default_str();
  app.add_option("--out", out, "write the rows as JSON here");
  app.add_option("--rank", rank, "(internal) this process's rank");
  app.add_option("--rendezvous", rendezvous, "(internal) the ranks' rendezvous");
  CLI11_PARSE(app, argc, argv);
  if (rank < 0) {  // the first process: start the others, then be rank 0
    rendezvous = free_loopback_rendezvous();
    for (int r = 1; r < parts; ++r) {
      if (::fork() == 0) {
        std::vector<std::string> args(argv, argv + argc);
        args.insert(args.end(), {"--rank", std::to_string(r), "--rendezvous", rendezvous});
        std::vector<char*> pointers;
        for (auto& a : args) pointers.push_back(a.data());
        pointers.push_back(nullptr);
        ::execv("/proc/self/exe", pointers.data());
        _exit(127);
      }
    }
    rank = 0;
  }
  const at::Device device = device_kind == "cuda" ? at::Device(at::kCUDA, rank) : at::Device(at::kCPU);
  // On CPU the parts share the host's cores.
  if (device.is_cpu())
    at::set_num_threads(std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency()) / parts));
  PartOptions options;
  options.rank = rank;
  options.world_size = parts;
  options.rendezvous = rendezvous;
  Bench bench(PartGroups::join(options, device, "rank " + std::to_string(rank)), rank, parts, device,
              parse_dtype_name(dtype_name), iterations);
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0) {
    std::printf("%-12s %-9s %7s %12s %16s %9s %10s\n", "layer", "op", "tokens", "one device", "tensor-parallel", "FSDP",
                "FSDP / TP");
  }
  for (const auto& shape : parse_shapes(shapes_text)) {
    for (const bool backward : {false, true}) {
      for (const int64_t tokens : parse_list(tokens_text)) {
        auto row = bench.measure(shape, tokens, backward);
        if (rank != 0) continue;
        std::printf("%-12s %-9s %7lld %9.3f ms %13.3f ms %6.3f ms %9.2fx\n",
                    (std::to_string(shape.out) + "x" + std::to_string(shape.in)).c_str(),
                    backward ? "backward" : "forward", static_cast<long long>(tokens),
                    row["one_device_ms"].get<double>(), row["tensor_parallel_ms"].get<double>(),
                    row["fsdp_ms"].get<double>(), row["fsdp_over_tensor_parallel"].get<double>());
        std::fflush(stdout);
        rows.push_back(row);
      }
    }
  }
  if (rank == 0) {
    if (!out.empty())
      std::ofstream(out)
          << nlohmann::json{{"parts", parts}, {"device", device_kind}, {"dtype", dtype_name}, {"rows", rows}}.dump(2);
    bool ok = true;
    for (int r = 1; r < parts; ++r) {
      int status = 0;
      ::wait(&status);
      ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return ok ? 0 : 1;
  }
  return 0;
}
