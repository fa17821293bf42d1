#pragma once
// [Torch-free kernels]
// Each kernel of this folder is a file pair, so that nvcc never parses LibTorch's headers, which
// were most of a kernel file's build (55-93 s a file on the 2-core machine; .cu files get no
// precompiled header):
//  - <name>.cu: the __global__ kernels and their launch API on raw pointers, sizes and a
//    cudaStream_t, declared in <name>_launch.h (namespace symbiosis::kernels::device). Neither
//    includes a LibTorch header, but for noise_mask.cu: the noise choice that it shares with the
//    host (kernels/noise_choice.h) is ATen's header-only Philox generator, which needs
//    c10/util/Exception.h.
//  - <name>.cpp: the public functions of <name>.h: checks, allocation, dtype dispatch, the current
//    stream and the device guard ([Operands' device]). It compiles against the libraries'
//    precompiled header ([Precompiled headers] in cmake/).
// A launch returns cudaGetLastError() after its kernels and the .cpp passes it to C10_CUDA_CHECK,
// as C10_CUDA_KERNEL_LAUNCH_CHECK did. Element types are CUDA's (kernels/cuda_types.h maps ATen's
// onto them); each launch is instantiated for those its .cpp dispatches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

// Explicit instantiations: X(T) for each element type of ATen's
// AT_DISPATCH_FLOATING_TYPES_AND2(kBFloat16, kHalf, ...), and of with_cuda_type
// (kernels/cuda_types.h) for the kernels that take fp32, bf16 and fp16 only.
#define SYMBIOSIS_FOR_FLOATING_TYPES(X) X(double) X(float) X(__nv_bfloat16) X(__half)
#define SYMBIOSIS_FOR_KERNEL_TYPES(X) X(float) X(__nv_bfloat16) X(__half)
