#include "kernels/few_rows_gemm.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/device_guard.h"
#include "kernels/gemm_operands.h"

namespace symbiosis::kernels {
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
        if constexpr (std::is_same_v<T, __nv_bfloat16>) f = __bfloat1622float2(pairs[i]);
        else f = __half22float2(pairs[i]);
        values[2 * i] = f.x;
        values[2 * i + 1] = f.y;
      }
    }
  }
};

template <typename T>
__device__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(v);
  else return __float2half(v);
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
__global__ void few_rows_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                                int rows, int64_t n, int64_t k) {
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

// Rows of `k` elements of this size, starting at `data`, are whole 16-byte vectors.
bool whole_vectors(const void* data, int64_t k, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && (k * element_size) % 16 == 0;
}

template <typename T>
void launch(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out) {
  const int64_t n = matrix.size(1);
  const int rows = static_cast<int>(x.size(0));
  const dim3 blocks(static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock)), threads(kWarpsPerBlock * 32);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto* x_data = static_cast<const T*>(x.data_ptr());
  const auto* weight = static_cast<const T*>(matrix.data_ptr());
  auto* out_data = static_cast<T*>(out.data_ptr());
  // The kernel for the smallest bound that holds `rows`.
  auto run = [&](auto bound) {
    few_rows_kernel<T, decltype(bound)::value><<<blocks, threads, 0, stream>>>(x_data, weight, out_data, rows, n,
                                                                                x.size(1));
  };
  if (rows == 1) {
    run(std::integral_constant<int, 1>{});
  } else if (rows == 2) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, kFewRowsMax>{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool few_rows_gemm(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out) {
  const auto device_guard = on_device_of(x);  // [Operands' device]
  if (!gemm_operands(x, matrix, out)) return false;
  const int64_t m = x.size(0), k = x.size(1), n = matrix.size(1);
  if (m < 1 || m > kFewRowsMax || n < 1) return false;
  // matrix is Wᵀ for a row-major W [n, k]: its rows are W's columns, one stride apart.
  if (matrix.stride(0) != 1 || matrix.stride(1) != k) return false;
  const auto element = x.element_size();
  if (!whole_vectors(x.data_ptr(), k, element) || !whole_vectors(matrix.data_ptr(), k, element)) return false;
  switch (x.scalar_type()) {
    case at::kFloat: launch<float>(x, matrix, out); break;
    case at::kBFloat16: launch<__nv_bfloat16>(x, matrix, out); break;
    default: launch<__half>(x, matrix, out); break;
  }
  return true;
}

}  // namespace symbiosis::kernels
