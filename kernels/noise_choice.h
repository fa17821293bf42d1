#pragma once
// [Noise choice]
// Which bank rows, with which signs, mask row `row` of a tenant's call number `call`: `mix` pairs
// drawn from a counter-based generator (Philox 4x32-10) keyed by the tenant's secret, so that the
// choice needs no state beyond the call's number. The host (CPU calls, in privacy/noise_mask.cpp)
// and the GPU (the fused kernels of kernels/noise_mask.h, which read the call's number from device
// memory, so a CUDA graph replays with a new choice each time: [Masked captures] in
// privacy/noise_mask.h) compute the same choice from the same (secret, call, row). It lives here,
// beside the kernels, so that privacy/ uses kernels/ and never the other way round.
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/macros/Macros.h>

#include <cstdint>

namespace symbiosis {

constexpr int kMaxNoiseMix = 8;  // bank rows summed into one row's noise, at most

// Fills index[0, mix) with bank rows in [0, bank_rows) and sign[0, mix) with +1 or -1.
C10_HOST_DEVICE inline void noise_choice(uint64_t secret, uint64_t call, uint64_t row, int64_t bank_rows, int mix,
                                         int64_t* index, float* sign) {
  // One subsequence per row, four counter blocks (16 draws, 2 per term) per call.
  at::Philox4_32 engine(secret, row, call * 4);
  for (int j = 0; j < mix; ++j) {
    const uint64_t draw = engine();
    index[j] = static_cast<int64_t>((draw * static_cast<uint64_t>(bank_rows)) >> 32);  // [0, bank_rows)
    sign[j] = (engine() & 1u) ? 1.f : -1.f;
  }
}

}  // namespace symbiosis
