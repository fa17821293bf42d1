// [Fused noise masking]: checks, allocation and dispatch; the kernels are in kernels/noise_mask.cu
// ([Torch-free kernels] in kernels/launch.h).
#include "kernels/noise_mask.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"
#include "kernels/noise_choice.h"
#include "kernels/noise_mask_launch.h"

namespace symbiosis::kernels {
namespace {

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
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mask_rows", [&] {
    C10_CUDA_CHECK(device::mask_rows(cuda_data<scalar_t>(x), x.stride(0), cuda_data<scalar_t>(bank), rows, features,
                                     bank.size(0), static_cast<int>(mix), call.data_ptr<int64_t>(), secret,
                                     result.norm.data_ptr<float>(), static_cast<float>(result.factor),
                                     cuda_data<scalar_t>(result.masked), result.choices.data_ptr<int32_t>(), stream));
  });
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
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const float* bias_data = bias.defined() ? bias.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "unmask_rows", [&] {
    C10_CUDA_CHECK(device::unmask_rows(cuda_data<scalar_t>(y), y.stride(0), cuda_data<scalar_t>(effect), rows, features,
                                       static_cast<int>(mix), masked.choices.data_ptr<int32_t>(),
                                       masked.norm.data_ptr<float>(), static_cast<float>(masked.factor), bias_data,
                                       cuda_data<scalar_t>(out), call.data_ptr<int64_t>(), stream));
  });
  return out;
}

}  // namespace symbiosis::kernels
