#include "kernels/noise_mask.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/device_guard.h"
#include "privacy/noise_choice.h"

namespace symbiosis::kernels {
namespace {

constexpr int kThreads = 256;

// A row's choice, decoded into shared memory: bank rows and signs over √mix.
struct RowChoice {
  int64_t index[kMaxNoiseMix];
  float sign[kMaxNoiseMix];
};

__device__ void decode(const int32_t* choices, int mix, RowChoice& choice) {
  const float norm = rsqrtf(static_cast<float>(mix));
  for (int j = 0; j < mix; ++j) {
    const int32_t c = choices[j];
    choice.index[j] = (c > 0 ? c : -c) - 1;
    choice.sign[j] = c > 0 ? norm : -norm;
  }
}

// kVec consecutive elements, loaded and stored as one (16 bytes of T, or one element).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <int kVec, typename T>
__device__ Pack<T, kVec> load(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

// One block a row: its choice (thread 0), then x + s·noise across its features.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    mask_kernel(const T* x, int64_t x_stride, const T* bank, int64_t features, int64_t bank_rows, int mix,
                const int64_t* call, uint64_t secret, const float* norm, float factor, T* out, int32_t* choices) {
  __shared__ RowChoice choice;
  const int64_t row = blockIdx.x;
  const T* in = x + row * x_stride;
  if (threadIdx.x == 0) {
    int64_t index[kMaxNoiseMix];
    float sign[kMaxNoiseMix];
    noise_choice(secret, static_cast<uint64_t>(*call), static_cast<uint64_t>(row), bank_rows, mix, index, sign);
    for (int j = 0; j < mix; ++j) {
      choices[row * mix + j] = static_cast<int32_t>(sign[j] > 0 ? index[j] + 1 : -(index[j] + 1));
    }
    decode(choices + row * mix, mix, choice);
  }
  __syncthreads();
  const float s = factor * *norm;
  for (int64_t f = threadIdx.x * int64_t{kVec}; f < features; f += int64_t{kThreads} * kVec) {
    float noise[kVec] = {};
    for (int j = 0; j < mix; ++j) {
      const auto b = load<kVec>(bank + choice.index[j] * features + f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) noise[i] += choice.sign[j] * static_cast<float>(b.v[i]);
    }
    const auto v = load<kVec>(in + f);
    Pack<T, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = static_cast<T>(static_cast<float>(v.v[i]) + s * noise[i]);
    *reinterpret_cast<Pack<T, kVec>*>(out + row * features + f) = o;
  }
}

// One block a row: y - s·effects (+ bias); block 0 advances the call's number.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    unmask_kernel(const T* y, int64_t y_stride, const T* effect, int64_t features, int mix, const int32_t* choices,
                  const float* norm, float factor, const float* bias, T* out, int64_t* call) {
  __shared__ RowChoice choice;
  const int64_t row = blockIdx.x;
  if (threadIdx.x == 0) {
    decode(choices + row * mix, mix, choice);
    if (row == 0) ++*call;  // every block of the mask read it: the mask ran before this on the stream
  }
  __syncthreads();
  const float s = factor * *norm;
  for (int64_t f = threadIdx.x * int64_t{kVec}; f < features; f += int64_t{kThreads} * kVec) {
    float value[kVec];
    const auto in = load<kVec>(y + row * y_stride + f);
#pragma unroll
    for (int i = 0; i < kVec; ++i) value[i] = static_cast<float>(in.v[i]);
    for (int j = 0; j < mix; ++j) {
      const auto e = load<kVec>(effect + choice.index[j] * features + f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) value[i] -= s * choice.sign[j] * static_cast<float>(e.v[i]);
    }
    if (bias != nullptr) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) value[i] += bias[f + i];
    }
    Pack<T, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = static_cast<T>(value[i]);
    *reinterpret_cast<Pack<T, kVec>*>(out + row * features + f) = o;
  }
}

// Whether rows of `features` elements at these addresses and row strides can go kVec at a time.
template <int kVec, typename T>
bool vectorizable(int64_t features, std::initializer_list<int64_t> strides, std::initializer_list<const T*> pointers) {
  if (features % kVec != 0) return false;
  for (const int64_t stride : strides) {
    if (stride % kVec != 0) return false;
  }
  for (const T* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) != 0) return false;
  }
  return true;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1), "noise mask: ", what,
              " must be a [rows, features] GPU tensor with contiguous rows, got ", t.sizes(), " on ", t.device());
}

void check_table(const at::Tensor& table, const at::Tensor& like, const char* what) {
  TORCH_CHECK(table.is_contiguous() && table.device() == like.device() && table.scalar_type() == like.scalar_type() &&
                  table.dim() == 2 && table.size(1) == like.size(1),
              "noise mask: ", what, " must be [bank_rows, ", like.size(1), "] in ", like.scalar_type(), " on ",
              like.device(), ", got ", table.sizes(), " in ", table.scalar_type(), " on ", table.device());
}

}  // namespace

MaskedRows mask_rows(const at::Tensor& x, const at::Tensor& bank, const at::Tensor& call, uint64_t secret, int64_t mix,
                     double ratio) {
  check_rows(x, "x");
  check_table(bank, x, "the bank");
  TORCH_CHECK(call.device() == x.device() && call.scalar_type() == at::kLong && call.numel() == 1,
              "noise mask: the call number must be one int64 on ", x.device());
  TORCH_CHECK(mix >= 1 && mix <= kMaxNoiseMix, "noise mask: mix must be in [1, ", kMaxNoiseMix, "], got ", mix);
  const auto device_guard = on_device_of(x);  // [Operands' device]
  const int64_t rows = x.size(0), features = x.size(1);
  MaskedRows result{at::empty({rows, features}, x.options()), at::empty({rows, mix}, x.options().dtype(at::kInt)),
                    // s = ratio × RMS(x) = factor × ‖x‖, the norm left on the GPU
                    at::linalg_vector_norm(x, 2, std::nullopt, false, at::kFloat),
                    x.numel() > 0 ? ratio / std::sqrt(static_cast<double>(x.numel())) : 0.0};
  if (rows == 0 || features == 0) return result;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mask_rows", [&] {
    using T = scalar_t;
    const T *in = x.data_ptr<T>(), *table = bank.data_ptr<T>();
    T* out = result.masked.data_ptr<T>();
    auto launch = [&](auto vec) {
      mask_kernel<T, decltype(vec)::value><<<rows, kThreads, 0, stream>>>(
          in, x.stride(0), table, features, bank.size(0), static_cast<int>(mix), call.data_ptr<int64_t>(), secret,
          result.norm.data_ptr<float>(), static_cast<float>(result.factor), out, result.choices.data_ptr<int32_t>());
    };
    constexpr int kVec = 16 / sizeof(T);
    if (vectorizable<kVec, T>(features, {x.stride(0)}, {in, table, out})) {
      launch(std::integral_constant<int, kVec>());
    } else {
      launch(std::integral_constant<int, 1>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result;
}

at::Tensor unmask_rows(const at::Tensor& y, const at::Tensor& effect, const MaskedRows& masked, const at::Tensor& bias,
                       const at::Tensor& call) {
  check_rows(y, "y");
  check_table(effect, y, "the effects");
  const int64_t rows = y.size(0), features = y.size(1), mix = masked.choices.size(1);
  TORCH_CHECK(rows == masked.choices.size(0), "noise mask: y has ", rows, " rows, the masked call ",
              masked.choices.size(0));
  TORCH_CHECK(!bias.defined() || (bias.is_contiguous() && bias.scalar_type() == at::kFloat &&
                                  bias.device() == y.device() && bias.numel() == features),
              "noise mask: the bias must be [", features, "] fp32 on ", y.device());
  TORCH_CHECK(call.device() == y.device() && call.scalar_type() == at::kLong && call.numel() == 1,
              "noise mask: the call number must be one int64 on ", y.device());
  const auto device_guard = on_device_of(y);  // [Operands' device]
  auto out = at::empty({rows, features}, y.options());
  if (rows == 0) return out;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const float* bias_data = bias.defined() ? bias.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "unmask_rows", [&] {
    using T = scalar_t;
    const T *in = y.data_ptr<T>(), *table = effect.data_ptr<T>();
    T* result = out.data_ptr<T>();
    auto launch = [&](auto vec) {
      unmask_kernel<T, decltype(vec)::value><<<rows, kThreads, 0, stream>>>(
          in, y.stride(0), table, features, static_cast<int>(mix), masked.choices.data_ptr<int32_t>(),
          masked.norm.data_ptr<float>(), static_cast<float>(masked.factor), bias_data, result,
          call.data_ptr<int64_t>());
    };
    constexpr int kVec = 16 / sizeof(T);
    if (features > 0 && vectorizable<kVec, T>(features, {y.stride(0)}, {in, table, result})) {
      launch(std::integral_constant<int, kVec>());
    } else {
      launch(std::integral_constant<int, 1>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace symbiosis::kernels
