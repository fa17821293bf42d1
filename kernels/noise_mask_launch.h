#pragma once
// [Fused noise masking]'s kernels, without LibTorch ([Torch-free kernels] in kernels/launch.h);
// callers use kernels/noise_mask.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels::device {

// out [rows, features] (contiguous) = x + s·noise with s = factor × *norm, for x's rows x_stride
// apart and a contiguous bank [bank_rows, features]; writes each row's choice to choices [rows,
// mix]. Reads the call's number from *call. On `stream`; rows, features ≥ 1.
template <typename T>
cudaError_t mask_rows(const T* x, int64_t x_stride, const T* bank, int64_t rows, int64_t features, int64_t bank_rows,
                      int mix, const int64_t* call, uint64_t secret, const float* norm, float factor, T* out,
                      int32_t* choices, cudaStream_t stream);

// out [rows, features] (contiguous) = y - s·(the chosen rows of effect) + bias (none where null),
// for y's rows y_stride apart; advances *call. On `stream`; rows ≥ 1.
template <typename T>
cudaError_t unmask_rows(const T* y, int64_t y_stride, const T* effect, int64_t rows, int64_t features, int mix,
                        const int32_t* choices, const float* norm, float factor, const float* bias, T* out,
                        int64_t* call, cudaStream_t stream);

}  // namespace symbiosis::kernels::device
