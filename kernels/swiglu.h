#pragma once
// [Fused SwiGLU]
// Llama's MLP activation silu(gate) · up and its gradients (grad · up · silu'(gate) for gate,
// grad · silu(gate) for up), each in one kernel that reads gate and up once and computes in fp32,
// rounding once. LibTorch runs two kernels forward and four backward, each a pass over a
// [tokens, intermediate] tensor; after a [Layer groups] call gate and up are the halves of one
// tensor, views that are not contiguous, which its strided path runs slower still. Rows whose
// addresses and strides allow it (Llama's do) go 16 bytes a thread at a time. Results match the
// expression within the dtype's rounding, not bit for bit. Built only with CUDA;
// client_runtime/models/llama.cpp calls it on a GPU.
#include <ATen/ATen.h>

namespace symbiosis::kernels {

// gate, up: the same shape [..., n], fp32, bf16 or fp16 on a GPU, each viewable as [rows, n] with
// the last dimension contiguous (contiguous tensors, or the halves of one). Returns silu(gate) ·
// up, contiguous.
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);

// Writes the gradients of Σ grad · silu(gate) · up into grad_gate and grad_up (gate's shape and
// dtype, viewable as [rows, n] like gate: new tensors, or the halves of one).
void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad_gate,
                     const at::Tensor& grad_up);

}  // namespace symbiosis::kernels
