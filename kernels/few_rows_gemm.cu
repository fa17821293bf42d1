// [Torch-free kernels] (kernels/launch.h): [Few-row GEMM]'s kernel; kernels/few_rows_gemm.cpp
// checks and launches.
#include "kernels/few_rows_gemm_launch.h"

#include <cstdint>
#include <type_traits>

namespace symbiosis::kernels::device {
namespace {

constexpr int kWarpsPerBlock = 8;  // one output column each

// A 16-byte vector of T, widened to floats.
template <typename T>
struct Vector {
  static constexpr int kCount = 16 / sizeof(T);
  float values[kCount];
  __device__ explicit Vector(int4 bits) {
    if constexpr (std::is_same_v<T, float>) {
      values[0] = __int_as_float(bits.x);
      values[1] = __int_as_float(bits.y);
      values[2] = __int_as_float(bits.z);
      values[3] = __int_as_float(bits.w);
    } else {
      using Pair = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
      const auto* pairs = reinterpret_cast<const Pair*>(&bits);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 f;
        if constexpr (std::is_same_v<T, __nv_bfloat16>)
          f = __bfloat1622float2(pairs[i]);
        else
          f = __half22float2(pairs[i]);
        values[2 * i] = f.x;
        values[2 * i + 1] = f.y;
      }
    }
  }
};

template <typename T>
__device__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16(v);
  else
    return __float2half(v);
}

// The weight is read once, so its loads skip L1 and leave it to x, which every warp reads.
__device__ int4 load_once(const int4* address) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(address));
  return v;
}

// Warp w of block b computes column b·kWarpsPerBlock + w of out for each of x's `rows` ≤ kRows
// rows: each lane sums every 32nd vector of the weight's row against the same vectors of x's rows,
// then the lanes' sums are added pairwise. kRows is a compile-time bound so that x's vectors and
// the sums stay in registers; with fewer rows a lane keeps more of the weight's loads in flight.
template <typename T, int kRows>
__global__ void few_rows_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out, int rows,
                                int64_t n, int64_t k) {
  constexpr int kUnroll = kRows <= 2 ? 4 : 2;
  const int lane = threadIdx.x % 32;
  const int64_t column = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  if (column >= n) return;
  const int64_t vectors = k / Vector<T>::kCount;
  const auto* weight_row = reinterpret_cast<const int4*>(weight + column * k);
  const auto* x_vectors = reinterpret_cast<const int4*>(x);
  float sums[kRows] = {};
#pragma unroll kUnroll
  for (int64_t v = lane; v < vectors; v += 32) {
    const int4 weight_bits = load_once(weight_row + v);
    int4 x_bits[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < rows) x_bits[r] = __ldg(x_vectors + r * vectors + v);
    }
    const Vector<T> w(weight_bits);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) continue;
      const Vector<T> xv(x_bits[r]);
#pragma unroll
      for (int i = 0; i < Vector<T>::kCount; ++i) sums[r] = fmaf(xv.values[i], w.values[i], sums[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows) continue;
    float s = sums[r];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) out[r * n + column] = from_float<T>(s);
  }
}

}  // namespace

template <typename T>
cudaError_t few_rows_gemm(const T* x, const T* weight, T* out, int rows, int64_t n, int64_t k, cudaStream_t stream) {
  const dim3 blocks(static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock)), threads(kWarpsPerBlock * 32);
  // The kernel for the smallest bound that holds `rows`.
  auto run = [&](auto bound) {
    few_rows_kernel<T, decltype(bound)::value><<<blocks, threads, 0, stream>>>(x, weight, out, rows, n, k);
  };
  if (rows == 1) {
    run(std::integral_constant<int, 1>{});
  } else if (rows == 2) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, kFewRowsMax>{});
  }
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T) \
  template cudaError_t few_rows_gemm<T>(const T*, const T*, T*, int, int64_t, int64_t, cudaStream_t);
SYMBIOSIS_FOR_KERNEL_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
