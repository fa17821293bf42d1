// symbiosis-bench-loss: a client's loss on the GPU, forward and backward, as the client runtime
// computes it ([Fused cross-entropy], token_cross_entropy) against the expression transformers and
// ATen use (the logits copied to fp32, then cross_entropy_loss), in the same run: GPU time an
// iteration (CUDA events) and the memory allocated at an iteration's peak beyond the logits
// (the gradient of the logits included). Defaults: Llama-3.2-1B's vocabulary at 2 x 512 tokens, bf16.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/autograd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>

#include <symbiosis/training.h>

namespace {

struct Measured {
  double ms = 0;          // GPU time of one forward and backward
  double peak_mib = 0;    // allocated at the peak of an iteration, beyond the logits (there before)
  at::Tensor loss, grad;  // of the last iteration
};

using Loss = std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& labels)>;

Measured measure(const Loss& loss_of, const at::Tensor& logits, const at::Tensor& labels, int iterations) {
  auto step = [&](Measured& m) {
    auto input = logits.detach().requires_grad_(true);
    m.loss = loss_of(input, labels);
    m.loss.backward();
    m.grad = input.grad();
  };
  Measured m;
  for (int i = 0; i < 3; ++i) step(m);  // warm: kernels loaded, the allocator's blocks cached
  const auto device = logits.device().index();
  c10::cuda::device_synchronize();
  m.loss.reset();  // and with it the graph, whose saved input holds the gradient
  m.grad.reset();
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
  const auto before = c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].current;
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  for (int i = 0; i < iterations; ++i) {
    m.loss.reset();
    m.grad.reset();
    step(m);
  }
  stop.record();
  stop.synchronize();
  m.ms = start.elapsed_time(stop) / iterations;
  const auto peak = c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].peak;
  m.peak_mib = static_cast<double>(peak - before) / (1 << 20);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The client's loss on the GPU: fused cross-entropy against the fp32 copy and ATen's"};
  int64_t tokens = 1024, vocab = 128256;
  int iterations = 50;
  std::string dtype_name = "bf16";
  app.add_option("--tokens", tokens, "rows of logits (batch x sequence)");
  app.add_option("--vocab", vocab, "the vocabulary");
  app.add_option("--dtype", dtype_name, "the logits' dtype: bf16, fp16 or fp32");
  app.add_option("--iterations", iterations, "timed iterations");
  CLI11_PARSE(app, argc, argv);
  if (!at::hasCUDA() || c10::cuda::device_count() == 0) {
    std::fprintf(stderr, "symbiosis-bench-loss: no CUDA device here; it measures the GPU path\n");
    return 1;
  }
  const auto dtype = dtype_name == "fp32" ? at::kFloat : dtype_name == "fp16" ? at::kHalf : at::kBFloat16;
  at::manual_seed(0);
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  const auto logits = at::randn({tokens, vocab}, options.dtype(at::kFloat)).mul_(4).to(dtype);
  const auto labels = at::randint(0, vocab, {tokens}, options.dtype(at::kLong));

  const auto fused =
      measure([](const at::Tensor& x, const at::Tensor& y) { return symbiosis::token_cross_entropy(x, y); }, logits,
              labels, iterations);
  const auto aten = measure(
      [](const at::Tensor& x, const at::Tensor& y) {
        return at::cross_entropy_loss(x.to(at::kFloat), y, {}, at::Reduction::Mean, symbiosis::kIgnoreIndex);
      },
      logits, labels, iterations);
  const double loss_difference = std::abs(fused.loss.item<double>() - aten.loss.item<double>());
  const double grad_difference = (fused.grad.to(at::kFloat) - aten.grad.to(at::kFloat)).abs().max().item<double>();
  std::printf("loss of [%lld, %lld] %s logits, forward and backward, %d iterations\n", (long long)tokens,
              (long long)vocab, dtype_name.c_str(), iterations);
  std::printf("%-34s %10s %10s\n", "", "GPU ms", "peak MiB");
  std::printf("%-34s %10.3f %10.1f\n", "fused (token_cross_entropy)", fused.ms, fused.peak_mib);
  std::printf("%-34s %10.3f %10.1f\n", "fp32 copy + at::cross_entropy_loss", aten.ms, aten.peak_mib);
  std::printf("fused / aten: time %.2fx, peak memory %.2fx; loss differs by %.3g, gradients by at most %.3g\n",
              fused.ms / aten.ms, fused.peak_mib / aten.peak_mib, loss_difference, grad_difference);
  return 0;
}
