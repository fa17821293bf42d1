// The CUDA kernels (kernels/): the executor's direct cuBLAS GEMM and few-row kernel, the batch
// packing kernel, and the clients' fused cross-entropy, decode attention, rotary embedding, SwiGLU,
// grouped LoRA, multi-LoRA and noise masking, each held to ATen's or the plain expression's result; and
// common/cuda.h's captured work beside another thread's wait. Skipped,
// with a message saying so, where there is no GPU.
#include <chrono>
#include <cmath>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "client_runtime/peft/lora.h"
#include "client_runtime/peft/dora.h"
#include "client_runtime/training/loss.h"
#include "common/cuda.h"
#include "kernels/batched_copy.h"
#include "kernels/decode_attention.h"
#include "kernels/direct_gemm.h"
#include "kernels/few_rows_gemm.h"
#include "kernels/lora.h"
#include "kernels/multi_lora.h"
#include "kernels/noise_choice.h"
#include "kernels/noise_mask.h"
#include "kernels/rotary.h"
#include "kernels/swiglu.h"
#include "tests/gpu_test_util.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace symbiosis {
namespace {

// [Direct cuBLAS]: the executor's GEMM equals ATen's product of the same operands, for both
// layouts a weight takes (Linear's forward uses Wᵀ, its backward W) and each dtype; operands it
// does not take (a non-contiguous input, a matrix on another device, an integer dtype) are left to
// ATen.
// gemm_into(x, matrix) takes the operands and equals at::mm of them within the dtype's tolerance.
void expect_like_aten(const at::Tensor& x, const at::Tensor& matrix, at::Tensor out) {
  ASSERT_TRUE(cuda::gemm_into(x, matrix, out));
  const auto expected = at::mm(x, matrix);
  const double tolerance = x.scalar_type() == at::kFloat ? 1e-5 : 1e-2;
  EXPECT_TRUE(at::allclose(out, expected, tolerance, tolerance))
      << "max difference " << (out - expected).abs().max().item<double>();
}

TEST(DirectGemmTest, EqualsAtenForEachLayoutAndDtype) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(11);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (int64_t tokens : {1, 37, 1024}) {
      const auto weight = at::randn({96, 64}, options) * 0.1;  // [out, in]
      for (const bool transposed : {true, false}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + ", " + std::to_string(tokens) + " tokens, " +
                     (transposed ? "x·Wᵀ" : "g·W"));
        const auto matrix = transposed ? weight.t() : weight;
        expect_like_aten(at::randn({tokens, matrix.size(0)}, options), matrix,
                         at::full({tokens, matrix.size(1)}, 7.0, options));
      }
    }
  }
  // Tensors that start one element past an allocation (a client may name any offset in its buffer).
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + ", unaligned");
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    const auto shifted = [&](int64_t rows, int64_t cols) {
      return at::randn({rows * cols + 1}, options).narrow(0, 1, rows * cols).view({rows, cols});
    };
    expect_like_aten(shifted(5, 64), shifted(96, 64).t(), shifted(5, 96));
  }
  const auto options = at::TensorOptions().device(at::kCUDA);
  auto out = at::empty({4, 8}, options);
  EXPECT_FALSE(cuda::gemm_into(at::randn({16, 4}, options).t(), at::randn({16, 8}, options), out));
  EXPECT_FALSE(cuda::gemm_into(at::randn({4, 16}, options), at::randn({16, 8}), out));  // a host matrix
  auto ints = at::empty({4, 8}, options.dtype(at::kInt));
  EXPECT_FALSE(
      cuda::gemm_into(at::ones({4, 16}, options.dtype(at::kInt)), at::ones({16, 8}, options.dtype(at::kInt)), ints));
}

// [Few-row GEMM]: a forward product of 1 to kFewRowsMax tokens equals ATen's within the dtype's
// tolerance, for widths that are and are not a multiple of the kernel's 32 lanes' vectors, a
// weight of more columns than one grid row of blocks, and an output whose columns are not a
// multiple of a block's; gemm_into takes it that way, and what the kernel does not take
// (more rows, the backward layout, an unaligned row) goes to cuBLAS, still equal to ATen.
TEST(FewRowsGemmTest, EqualsAtenForEachNumberOfTokensDtypeAndShape) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(12);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    const std::vector<std::pair<int64_t, int64_t>> shapes{{64, 96}, {2048, 2051}, {8200, 40}};  // [in, out]
    for (const auto& [in, out_features] : shapes) {
      const auto weight = at::randn({out_features, in}, options) * 0.05;  // [out, in]
      for (int64_t tokens = 1; tokens <= kernels::kFewRowsMax; ++tokens) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + ", [" + std::to_string(out_features) + ", " +
                     std::to_string(in) + "], " + std::to_string(tokens) + " tokens");
        const auto x = at::randn({tokens, in}, options);
        auto out = at::full({tokens, out_features}, 7.0, options);
        ASSERT_TRUE(kernels::few_rows_gemm(x, weight.t(), out));
        const auto expected = at::mm(x.to(at::kDouble), weight.t().to(at::kDouble));
        // Against a float64 product: fp32 sums of 8 200 terms, or the dtype's own rounding.
        const double tolerance = dtype == at::kFloat ? 1e-5 : 1e-2;
        EXPECT_TRUE(at::allclose(out.to(at::kDouble), expected, tolerance, tolerance))
            << "max difference " << (out.to(at::kDouble) - expected).abs().max().item<double>();
        expect_like_aten(x, weight.t(), at::empty({tokens, out_features}, options));
      }
    }
  }
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto weight = at::randn({96, 64}, options);
  constexpr int64_t kTooMany = kernels::kFewRowsMax + 1;
  auto out = at::empty({kTooMany, 96}, options);
  EXPECT_FALSE(kernels::few_rows_gemm(at::randn({kTooMany, 64}, options), weight.t(), out));
  expect_like_aten(at::randn({kTooMany, 64}, options), weight.t(), out);
  auto backward_out = at::empty({1, 64}, options);
  EXPECT_FALSE(kernels::few_rows_gemm(at::randn({1, 96}, options), weight, backward_out));  // g·W
  const auto unaligned = at::randn({65}, options).narrow(0, 1, 64).view({1, 64});
  auto one_row = at::empty({1, 96}, options);
  EXPECT_FALSE(kernels::few_rows_gemm(unaligned, weight.t(), one_row));
  expect_like_aten(unaligned, weight.t(), one_row);
}

// [Fused cross-entropy] against ATen's expression (logits copied to fp32, then
// cross_entropy_loss): losses and gradients for each logits dtype, a vocabulary of whole 16-byte
// vectors (Llama 3's) and one that is not, rows that start off alignment, ignored labels, large
// logits (the log-sum-exp must subtract the maximum), both reductions.
TEST(FusedCrossEntropyTest, EqualsAtenInFp32ForEachDtypeVocabularyAndReduction) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(5);
  constexpr int64_t kRows = 37;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t vocab : {128256, 1001}) {
      for (bool aligned : {true, false}) {
        for (auto reduction : {at::Reduction::Mean, at::Reduction::Sum}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + ", vocabulary " + std::to_string(vocab) +
                       (aligned ? "" : ", rows off alignment") +
                       (reduction == at::Reduction::Mean ? ", mean" : ", sum"));
          const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
          const int64_t shift = aligned ? 0 : 1;
          const auto values = (at::randn({kRows * vocab + shift}, options.dtype(at::kFloat)) * 8).to(dtype);
          const auto logits = values.narrow(0, shift, kRows * vocab).view({kRows, vocab});
          const auto ignored = at::arange(0, kRows, 5, options.dtype(at::kLong));
          const auto labels =
              at::randint(0, vocab, {kRows}, options.dtype(at::kLong)).index_fill_(0, ignored, kIgnoreIndex);

          const auto ours_in = logits.detach().clone().requires_grad_(true);
          const auto ours = token_cross_entropy(ours_in, labels, reduction);
          ours.backward();
          const auto aten_in = logits.detach().clone().requires_grad_(true);
          const auto aten = at::cross_entropy_loss(aten_in.to(at::kFloat), labels, {}, reduction, kIgnoreIndex);
          aten.backward();

          EXPECT_EQ(ours.scalar_type(), at::kFloat);
          EXPECT_NEAR(ours.item<double>(), aten.item<double>(), 1e-5 * std::abs(aten.item<double>()));
          // Gradients: fp32 rounding, then one step of the dtype's where the dtype is narrower.
          ASSERT_EQ(ours_in.grad().scalar_type(), dtype);
          const auto got = ours_in.grad().to(at::kDouble), want = aten_in.grad().to(at::kDouble);
          const double rtol = dtype == at::kFloat ? 1e-4 : dtype == at::kBFloat16 ? 1e-2 : 2e-3;
          EXPECT_TRUE(at::allclose(got, want, rtol, 1e-7))
              << "max difference " << (got - want).abs().max().item<double>();
          EXPECT_EQ(ours_in.grad().index_select(0, ignored).abs().max().item<double>(), 0.0);
        }
      }
    }
  }
  // Every label ignored: the mean is NaN, as ATen's (and transformers') is.
  const auto logits = at::randn({4, 64}, at::TensorOptions().device(at::kCUDA));
  const auto none = at::full({4}, kIgnoreIndex, logits.options().dtype(at::kLong));
  EXPECT_TRUE(std::isnan(token_cross_entropy(logits, none).item<double>()));
  EXPECT_EQ(token_cross_entropy(logits, none, at::Reduction::Sum).item<double>(), 0.0);
  // Labels that are not int64 are refused, naming what was expected.
  try {
    token_cross_entropy(logits, none.to(at::kInt));
    ADD_FAILURE() << "int32 labels were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("labels must be int64"), std::string::npos)
        << e.what_without_backtrace();
  }
}

// Within the dtype's rounding of `want` (a float64 computation), relative to the tensor's largest
// element: fp32 arithmetic rounded once into the dtype.
void expect_rounded_like(const at::Tensor& got, const at::Tensor& want) {
  const auto dtype = got.scalar_type();
  const double rtol = dtype == at::kFloat ? 1e-5 : dtype == at::kBFloat16 ? 8e-3 : 1e-3;
  EXPECT_LE(testing::relative_error(got, want), rtol) << c10::toString(dtype);
}

// [Multi-LoRA kernel] against the plain loop in float64: random adapters of mixed ranks (1 to 64)
// in 5 slots, one of them without this layer, rows taking any slot or none (-1), in segments
// (prefill) and one by one (decode), a base that is a view with a row stride of its own; fp32 and
// bf16. Then in a CUDA graph: slots and table rewritten between replays, each replay applies what
// they hold then.
TEST(MultiLoraKernelTest, EqualsThePlainLoopForMixedRanksAndFollowsItsTablesInAGraph) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(13);
  const int64_t in = 96, out = 80;
  const std::vector<int64_t> ranks = {8, 1, 64, 0, 16};  // slot 3: no adapter here
  // The plain loop: row by row, its slot's x·Aᵀ·Bᵀ·s on base, in float64.
  const auto expected = [&](const at::Tensor& base, const at::Tensor& x, const std::vector<int32_t>& slots,
                            const std::vector<kernels::MultiLoraEntry>& entries) {
    auto want = base.to(at::kDouble).clone();
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] < 0 || !entries[slots[i]].a.defined()) continue;
      const auto& e = entries[slots[i]];
      const auto row = x[static_cast<int64_t>(i)].to(at::kDouble).unsqueeze(0);
      want[static_cast<int64_t>(i)].add_(at::mm(at::mm(row, e.a.to(at::kDouble).t()), e.b.to(at::kDouble).t())[0] *
                                         e.scaling);
    }
    return want;
  };
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    std::vector<kernels::MultiLoraEntry> entries;
    for (size_t s = 0; s < ranks.size(); ++s) {
      if (ranks[s] == 0) {
        entries.push_back({});
        continue;
      }
      entries.push_back({at::randn({ranks[s], in}, options) * 0.2, at::randn({out, ranks[s]}, options) * 0.2,
                         0.5 + static_cast<double>(s)});
    }
    const auto table = kernels::multi_lora_table(entries).to(at::kCUDA);
    for (const bool segments : {true, false}) {
      for (const int64_t rows : {1, 7, 300}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + ", " + std::to_string(rows) + " rows" +
                     (segments ? " in segments" : " one by one"));
        std::vector<int32_t> slots;
        for (int64_t i = 0; i < rows; ++i) {
          slots.push_back(segments ? static_cast<int32_t>(i * 6 / rows) - 1 : static_cast<int32_t>((i * 7) % 6) - 1);
        }
        const auto x = at::randn({rows, in}, options);
        const auto wide = at::randn({rows, out + 16}, options);
        const auto base = wide.narrow(1, 8, out);  // rows out + 16 apart
        const auto got = kernels::multi_lora(base, x, at::tensor(slots, at::kInt).to(at::kCUDA), table, 64);
        expect_rounded_like(got, expected(base, x, slots, entries));
      }
    }
  }
  // In a CUDA graph: the slots and the table are read at each replay.
  const auto options = at::TensorOptions().device(at::kCUDA);
  const int64_t rows = 5;
  const auto x = at::randn({rows, in}, options), base = at::randn({rows, out}, options);
  std::vector<kernels::MultiLoraEntry> first = {{at::randn({4, in}, options), at::randn({out, 4}, options), 2.0}, {}};
  std::vector<kernels::MultiLoraEntry> second = {
      first[0], {at::randn({32, in}, options) * 0.1, at::randn({out, 32}, options), 0.25}};
  auto table = kernels::multi_lora_table(first).to(at::kCUDA);
  auto slots = at::zeros({rows}, options.dtype(at::kInt));
  const auto stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(stream);
  kernels::multi_lora(base, x, slots, table, 32);  // warm-up outside the graph
  at::cuda::CUDAGraph graph;
  at::Tensor got;
  graph.capture_begin();
  got = kernels::multi_lora(base, x, slots, table, 32);
  graph.capture_end();
  const std::vector<int32_t> mixed = {1, -1, 0, 1, 0};
  slots.copy_(at::tensor(mixed, at::kInt));
  graph.replay();
  stream.synchronize();
  expect_rounded_like(got, expected(base, x, mixed, first));  // slot 1 empty: base alone
  table.copy_(kernels::multi_lora_table(second));
  graph.replay();
  stream.synchronize();
  expect_rounded_like(got, expected(base, x, mixed, second));
  EXPECT_GT(testing::relative_error(got, expected(base, x, mixed, first)), 1e-3);  // slot 1 now counts
  try {
    kernels::multi_lora(base, x, slots.to(at::kLong), table, 32);
    ADD_FAILURE() << "int64 slots were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("multi_lora: slots must be [5] int32"), std::string::npos)
        << e.what_without_backtrace();
  }
}

// [Fused decode attention] against float64: the cache after the step holds each sequence's new key
// and value at its position (and nothing else changed), and each query head attends over its kv
// head's keys 0..position, for grouped and plain multi-head shapes, sequences in any slots (one
// at position 0), q laid out as the model passes it (a transpose), each dtype.
TEST(FusedDecodeAttentionTest, WritesTheNewKeysAndAttendsUpToEachPosition) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(5);
  struct Shape {
    int64_t heads, kv_heads, dim;
  };
  for (const Shape shape : {Shape{8, 2, 64}, Shape{4, 4, 128}, Shape{6, 1, 32}}) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(std::to_string(shape.heads) + " heads over " + std::to_string(shape.kv_heads) + ", dim " +
                   std::to_string(shape.dim) + ", " + c10::toString(dtype));
      ASSERT_TRUE(kernels::decode_attention_supports(shape.heads, shape.kv_heads, shape.dim, dtype));
      const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
      const int64_t slots = 5, tokens = 150;
      auto keys = at::randn({slots, shape.kv_heads, tokens, shape.dim}, options);
      auto values = at::randn({slots, shape.kv_heads, tokens, shape.dim}, options);
      const auto keys_before = keys.clone(), values_before = values.clone();
      const auto slot = at::tensor({3, 0, 4}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
      const auto position = at::tensor({149, 0, 77}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
      const auto q = at::randn({shape.heads, 3, shape.dim}, options).transpose(0, 1);  // [3, heads, dim], strided
      const auto k = at::randn({3, shape.kv_heads, shape.dim}, options);
      const auto v = at::randn({3, shape.kv_heads, shape.dim}, options);
      const auto got = kernels::decode_attention(q, k, v, keys, values, slot, position);
      ASSERT_EQ(got.sizes(), (std::vector<int64_t>{3, shape.heads, shape.dim}));
      auto expected_keys = keys_before.clone(), expected_values = values_before.clone();
      const auto group = shape.heads / shape.kv_heads;
      std::vector<at::Tensor> rows;
      for (int64_t b = 0; b < 3; ++b) {
        const int64_t s = slot[b].item<int64_t>(), p = position[b].item<int64_t>();
        expected_keys[s].select(1, p).copy_(k[b]);
        expected_values[s].select(1, p).copy_(v[b]);
        // [heads, p + 1, dim] keys and values of each query head's kv head, in float64.
        auto own_keys = expected_keys[s].narrow(1, 0, p + 1).to(at::kDouble).repeat_interleave(group, 0);
        auto own_values = expected_values[s].narrow(1, 0, p + 1).to(at::kDouble).repeat_interleave(group, 0);
        auto scores =
            at::matmul(q[b].to(at::kDouble).unsqueeze(1), own_keys.transpose(1, 2)) / std::sqrt(double(shape.dim));
        rows.push_back(at::matmul(at::softmax(scores, -1), own_values).squeeze(1));
      }
      EXPECT_TRUE(at::equal(keys, expected_keys));
      EXPECT_TRUE(at::equal(values, expected_values));
      expect_rounded_like(got, at::stack(rows));
    }
  }
  const auto options = at::TensorOptions().device(at::kCUDA);
  EXPECT_FALSE(kernels::decode_attention_supports(12, 1, 128, at::kFloat));  // 12 query heads a kv head
  EXPECT_FALSE(kernels::decode_attention_supports(64, 8, 128, at::kFloat));  // 8 x 128 elements a group
  EXPECT_FALSE(kernels::decode_attention_supports(8, 8, 80, at::kFloat));    // a head_dim not a multiple of 32
  auto keys = at::zeros({2, 2, 4, 64}, options), values = at::zeros({2, 2, 4, 64}, options);
  const auto index = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
  try {
    kernels::decode_attention(at::randn({1, 4, 64}, options), at::randn({1, 2, 64}, options),
                              at::randn({1, 2, 64}, options), keys, values, index, index);
    ADD_FAILURE() << "int32 slots were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("slots and positions must be [1] int64"), std::string::npos)
        << e.what_without_backtrace();
  }
}

// x·cos + rotate_half(x)·sin, and its transpose, in float64.
at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  auto x64 = x.to(at::kDouble), c = cos.to(at::kDouble), s = sin.to(at::kDouble);
  auto rotate_half = [](const at::Tensor& t) {
    const int64_t half = t.size(-1) / 2;
    return at::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
  };
  return backward ? x64 * c - rotate_half(x64 * s) : x64 * c + rotate_half(x64) * s;
}

// [Fused rotary embedding] against float64, for q laid out as the model passes it ([batch, heads,
// tokens, dim], a transpose of [batch, tokens, heads, dim]) and contiguous, cos and sin of one
// batch or of each, each dtype; inputs it cannot take are refused naming what was expected.
TEST(FusedRotaryTest, EqualsTheExpressionForwardAndBackwardForEachLayoutAndDtype) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(7);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (int64_t angle_batches : {1, 2}) {
      const auto angles = at::rand({angle_batches, 1, 9, 64}, options.dtype(at::kFloat)) * 6;
      const auto cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
      const auto transposed = at::randn({2, 9, 5, 64}, options).transpose(1, 2);  // [2, 5, 9, 64]
      for (const auto& x : {transposed, transposed.contiguous()}) {
        for (bool backward : {false, true}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + (x.is_contiguous() ? ", contiguous" : ", transposed") +
                       (backward ? ", backward" : ", forward") + ", " + std::to_string(angle_batches) +
                       " batch(es) of angles");
          const auto got = kernels::rotary(x, cos, sin, backward);
          EXPECT_EQ(got.sizes(), x.sizes());
          expect_rounded_like(got, rotary_reference(x, cos, sin, backward));
        }
      }
    }
  }
  const auto x = at::randn({1, 2, 3, 8}, at::TensorOptions().device(at::kCUDA));
  try {
    kernels::rotary(x, x.narrow(1, 0, 1), x.narrow(1, 0, 1).to(at::kBFloat16), false);
    ADD_FAILURE() << "angles of another dtype were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("rotary: cos and sin must be [1 or 1, 1, 3, 8] in Float"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

// [Fused SwiGLU] against float64, for gate and up apart and as the halves of one tensor (what a
// [Layer groups] call gives), each dtype, forward and both gradients.
TEST(FusedSwiGLUTest, EqualsTheExpressionForwardAndBackwardApartAndStacked) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(8);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (int64_t n : {1000, 1003}) {  // rows that go 16 bytes at a time, and rows that cannot
      const auto stacked = at::randn({3, 7, 2 * n}, options) * 3;
      const auto grad = at::randn({3, 7, n}, options);
      for (bool halves : {true, false}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + (halves ? ", halves of one tensor" : ", apart") + ", " +
                     std::to_string(n) + " columns");
        auto gate = stacked.narrow(-1, 0, n), up = stacked.narrow(-1, n, n);
        if (!halves) {
          gate = gate.contiguous();
          up = up.contiguous();
        }
        const auto g64 = gate.to(at::kDouble), u64 = up.to(at::kDouble), dy = grad.to(at::kDouble);
        const auto s = at::sigmoid(g64);
        expect_rounded_like(kernels::swiglu_forward(gate, up), g64 * s * u64);
        auto grads = at::empty({3, 7, 2 * n}, options);
        kernels::swiglu_backward(grad, gate, up, grads.narrow(-1, 0, n), grads.narrow(-1, n, n));
        expect_rounded_like(grads.narrow(-1, 0, n), dy * u64 * s * (1 + g64 * (1 - s)));
        expect_rounded_like(grads.narrow(-1, n, n), dy * g64 * s);
      }
    }
  }
}

// [Grouped LoRA] against float64: three layers' bases side by side (the first and last adapted, of
// ranks 8 and 4, the middle one not; then all three), each dtype, the output and every gradient
// (base, x, each A and B); a single adapter's forward goes the same way; adapters that cannot go
// together (DoRA, another dtype than the model's) are left to wrap their own parts.
TEST(GroupedLoraTest, EqualsTheExpressionAndEveryGradientForEachDtype) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(9);
  const int64_t in = 96;
  const std::vector<int64_t> widths = {64, 32, 48};
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (bool all : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (all ? ", all three adapted" : ", the middle one not"));
      std::vector<std::shared_ptr<LoraAdapterImpl>> loras;
      std::vector<LayerAdapterImpl*> adapters;
      for (size_t i = 0; i < widths.size(); ++i) {
        LoraConfig config;
        config.r = i == 2 ? 4 : 8;
        config.alpha = 4.0 * static_cast<double>(i + 1);
        config.init_b_zero = false;
        loras.push_back(std::make_shared<LoraAdapterImpl>(in, widths[i], config));
        loras.back()->to(at::kCUDA, dtype);
        adapters.push_back(all || i != 1 ? loras.back().get() : nullptr);
      }
      const auto x = at::randn({2, 5, in}, options).requires_grad_();
      const auto base = at::randn({2, 5, 144}, options).requires_grad_();
      const auto got = loras[0]->forward_group(x, base, adapters, widths);
      ASSERT_TRUE(got.defined());
      const auto w = at::randn(got.sizes(), options);
      got.backward(w);

      const auto x64 = x.detach().to(at::kDouble), w64 = w.to(at::kDouble);
      auto want = base.detach().to(at::kDouble).clone();
      auto want_dx = at::zeros_like(x64);
      int64_t column = 0;
      for (size_t i = 0; i < widths.size(); column += widths[i], ++i) {
        if (adapters[i] == nullptr) continue;
        const auto& lora = *loras[i];
        const auto a = lora.lora_A.detach().to(at::kDouble), b = lora.lora_B.detach().to(at::kDouble);
        const auto wm = w64.narrow(-1, column, widths[i]);
        want.narrow(-1, column, widths[i]).add_(at::matmul(at::matmul(x64, a.t()), b.t()) * lora.scaling);
        const auto grad_h = at::matmul(wm, b) * lora.scaling;  // [2, 5, r]
        want_dx += at::matmul(grad_h, a);
        expect_rounded_like(lora.lora_A.grad(), at::matmul(grad_h.reshape({10, -1}).t(), x64.reshape({10, in})));
        expect_rounded_like(
            lora.lora_B.grad(),
            at::matmul(wm.reshape({10, -1}).t(), at::matmul(x64, a.t()).reshape({10, -1})) * lora.scaling);
      }
      expect_rounded_like(got, want);
      expect_rounded_like(x.grad(), want_dx);
      EXPECT_TRUE(at::equal(base.grad(), w));
      if (!all) EXPECT_FALSE(loras[1]->lora_A.grad().defined());

      // One adapter alone, through its forward: the group of one.
      const auto y = base.detach().narrow(-1, 0, 64).contiguous();
      const auto alone = loras[0]->forward(x.detach(), [&](const at::Tensor&) { return y; });
      expect_rounded_like(alone, want.narrow(-1, 0, 64));
    }
  }
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto x = at::randn({1, 3, in}, options), base = at::randn({1, 3, 64}, options);
  LoraConfig config;
  auto other_dtype = std::make_shared<LoraAdapterImpl>(in, 64, config);
  other_dtype->to(at::kCUDA, at::kFloat);
  EXPECT_FALSE(other_dtype->forward_group(x, base, {other_dtype.get()}, {64}).defined());
  config.use_dora = true;
  auto dora = std::make_shared<DoraAdapterImpl>(in, 64, config);
  dora->to(at::kCUDA, at::kBFloat16);
  EXPECT_FALSE(dora->forward_group(x, base, {dora.get()}, {64}).defined());
  // The kernel itself refuses a B it cannot read, naming what it expected.
  try {
    kernels::lora_expand(base.view({3, 64}), at::zeros({3, 8}, options), {{0, 64, other_dtype->lora_B, 0, 2.0}});
    ADD_FAILURE() << "a B of another dtype was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("lora_expand: a member's B must be [64, rank] contiguous in BFloat16 on cuda:0, got [64, 8] in "
                        "Float"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(BatchedCopyKernelTest, PacksAndUnpacksLikeCatAndSplitForAnySizes) {
  SKIP_WITHOUT_GPUS(1);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t features : {2048, 3}) {  // 3 features: rows not 16-byte multiples, the fallback path
      std::vector<at::Tensor> parts, rows, back;
      const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
      int64_t total = 0;
      for (int64_t tokens : {1, 7, 128, 3, 1024}) {
        parts.push_back(at::randn({tokens, features}, options));
        total += tokens;
      }
      auto packed = at::empty({total, features}, options);
      int64_t offset = 0;
      for (const auto& p : parts) {
        rows.push_back(packed.narrow(0, offset, p.size(0)));
        back.push_back(at::empty_like(p));
        offset += p.size(0);
      }
      kernels::copy_tensors(parts, rows);
      EXPECT_TRUE(packed.equal(at::cat(parts, 0)));
      kernels::copy_tensors(rows, back);
      for (size_t i = 0; i < parts.size(); ++i) EXPECT_TRUE(back[i].equal(parts[i]));
    }
  }
}

// [Fused noise masking]: mask_rows chooses each row's bank rows as [Noise choice] does on the host
// for the call's number it reads on the GPU, and masks as the expression in fp32 does; unmask_rows takes the same combination of effects off (and adds the bias)
// and advances the call's number; so in a CUDA graph each replay chooses anew ([Masked captures]).
struct NoiseReference {
  at::Tensor index, sign;  // [mix, rows] bank rows, [mix, rows, 1] signs over √mix, from the host
};

NoiseReference host_choice(uint64_t secret, uint64_t call, int64_t rows, int64_t bank_rows, int64_t mix) {
  auto index = at::empty({mix, rows}, at::kLong);
  auto sign = at::empty({mix, rows, 1}, at::kDouble);
  for (int64_t row = 0; row < rows; ++row) {
    int64_t i[kMaxNoiseMix];
    float s[kMaxNoiseMix];
    noise_choice(secret, call, row, bank_rows, static_cast<int>(mix), i, s);
    for (int64_t j = 0; j < mix; ++j) {
      index[j][row] = i[j];
      sign[j][row][0] = s[j] / std::sqrt(static_cast<double>(mix));
    }
  }
  return {index, sign};
}

// The signed sum of the chosen rows of `table`, in float64.
at::Tensor mixed(const at::Tensor& table, const NoiseReference& choice) {
  const auto mix = choice.index.size(0), rows = choice.index.size(1);
  return (table.to(at::kDouble).cpu().index_select(0, choice.index.view(-1)).view({mix, rows, -1}) * choice.sign)
      .sum(0);
}

TEST(NoiseMaskKernelTest, MasksAndUnmasksLikeTheExpressionWithTheHostsChoice) {
  SKIP_WITHOUT_GPUS(1);
  constexpr uint64_t kSecret = 0x5eed;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t mix : {1, 2, 8}) {
      for (int64_t features : {96, 37}) {  // 37: rows not 16-byte multiples, one element at a time
        const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
        const int64_t rows = 37, out_features = features + 8, bank_rows = 16;
        const auto x = at::randn({rows, features}, options);
        const auto bank = at::randn({bank_rows, features}, options);
        const auto call = at::full({1}, 5, options.dtype(at::kLong));
        const auto masked = kernels::mask_rows(x, bank, call, kSecret, mix, 4.0);
        const auto choice = host_choice(kSecret, 5, rows, bank_rows, mix);
        const auto x64 = x.to(at::kDouble).cpu();
        const double scale = 4.0 * x64.square().mean().sqrt().item<double>();
        const double tolerance = dtype == at::kFloat ? 1e-5 : 1e-2;
        const std::string what =
            std::string(c10::toString(dtype)) + " mix " + std::to_string(mix) + " features " + std::to_string(features);
        EXPECT_NEAR(masked.factor * masked.norm.item<double>(), scale, 1e-5 * scale) << what;
        const auto want = x64 + scale * mixed(bank, choice);
        EXPECT_LT((masked.masked.to(at::kDouble).cpu() - want).abs().max().item<double>(),
                  tolerance * want.abs().max().item<double>())
            << what;
        const auto y = at::randn({rows, out_features}, options);
        const auto effect = at::randn({bank_rows, out_features}, options);
        const auto bias = at::randn({out_features}, options.dtype(at::kFloat));
        const auto got = kernels::unmask_rows(y, effect, masked, bias, call);
        ASSERT_EQ(got.scalar_type(), dtype);
        const auto expected = y.to(at::kDouble).cpu() - scale * mixed(effect, choice) + bias.to(at::kDouble).cpu();
        EXPECT_LT((got.to(at::kDouble).cpu() - expected).abs().max().item<double>(),
                  tolerance * expected.abs().max().item<double>())
            << what;
        EXPECT_EQ(call.item<int64_t>(), 6) << what;  // advanced by the unmask
      }
    }
  }
}

TEST(NoiseMaskKernelTest, AReplayedGraphChoosesAnewEachTime) {
  SKIP_WITHOUT_GPUS(1);
  constexpr uint64_t kSecret = 77;
  const auto options = at::TensorOptions().device(at::kCUDA);
  const int64_t rows = 9, bank_rows = 256, mix = 2;
  const auto x = at::randn({rows, 64}, options);
  const auto bank = at::randn({bank_rows, 64}, options);
  const auto effect = at::randn({bank_rows, 32}, options);
  const auto y = at::randn({rows, 32}, options);
  auto call = at::zeros({1}, options.dtype(at::kLong));
  const auto stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(stream);
  kernels::unmask_rows(y, effect, kernels::mask_rows(x, bank, call, kSecret, mix, 4.0), {}, call);  // call 0
  at::cuda::CUDAGraph graph;
  kernels::MaskedRows masked;
  graph.capture_begin();
  masked = kernels::mask_rows(x, bank, call, kSecret, mix, 4.0);
  kernels::unmask_rows(y, effect, masked, {}, call);
  graph.capture_end();
  std::set<std::vector<int32_t>> seen;
  for (uint64_t replay = 1; replay <= 4; ++replay) {
    graph.replay();
    stream.synchronize();
    const auto choice = host_choice(kSecret, replay, rows, bank_rows, mix);
    const auto index = (masked.choices.cpu().abs() - 1).t().contiguous().to(at::kLong);
    EXPECT_TRUE(index.equal(choice.index)) << "replay " << replay;
    const auto got = masked.choices.cpu().contiguous().view(-1);
    seen.insert(std::vector<int32_t>(got.data_ptr<int32_t>(), got.data_ptr<int32_t>() + got.numel()));
  }
  EXPECT_EQ(seen.size(), 4u);  // four replays, four choices
  EXPECT_EQ(call.item<int64_t>(), 5);
}

// [Captures and synchronizations] (common/cuda.h): a stream synchronized from another thread while
// it is being captured waits for the capture rather than spoiling it, and a capture that fails
// leaves no error behind for the stream's next GEMM to take for its own.
TEST(CapturedWorkTest, AWaitFromAnotherThreadLetsTheCaptureEndAndAFailedCaptureLeavesNoError) {
  SKIP_WITHOUT_GPUS(1);
  at::manual_seed(13);
  const cuda::Stream stream{c10::cuda::getStreamFromPool().stream(), 0};
  const cuda::CurrentStreamScope current(stream);
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto x = at::randn({8, 64}, options), matrix = at::randn({64, 96}, options);
  auto out = at::zeros({8, 96}, options);
  const auto expected = at::mm(x, matrix);
  ASSERT_TRUE(cuda::gemm_into(x, matrix, out));  // the GEMM library's handle is made outside the capture
  cuda::synchronize_stream(stream);

  std::future<void> waited;
  const auto work = cuda::CapturedWork::capture(stream, [&] {
    ASSERT_TRUE(cuda::gemm_into(x, matrix, out));
    waited = std::async(std::launch::async, [&] { cuda::synchronize_stream(stream); });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the other thread's wait has begun
    ASSERT_TRUE(cuda::gemm_into(x, matrix, out));
  });
  waited.get();  // throws what the wait threw
  work.launch(stream);
  cuda::synchronize_stream(stream);
  EXPECT_TRUE(at::allclose(out, expected, 1e-2, 1e-2));

  EXPECT_THROW(cuda::CapturedWork::capture(stream,
                                           [&] {
                                             // Not allowed while capturing: the capture fails.
                                             const auto status =
                                                 cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle));
                                             TORCH_CHECK(status == cudaSuccess, cudaGetErrorString(status));
                                           }),
               c10::Error);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  out.zero_();
  ASSERT_TRUE(cuda::gemm_into(x, matrix, out));
  cuda::synchronize_stream(stream);
  EXPECT_TRUE(at::allclose(out, expected, 1e-2, 1e-2));
}

}  // namespace
}  // namespace symbiosis
