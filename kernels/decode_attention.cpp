// [Fused decode attention]: checks, allocation and dispatch; the kernels are in
// kernels/decode_attention.cu ([Torch-free kernels] in kernels/launch.h).
#include "kernels/decode_attention.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>

#include "kernels/cuda_types.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/device_guard.h"

namespace symbiosis::kernels {

bool decode_attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim, at::ScalarType dtype) {
  const bool dtype_ok = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  return dtype_ok && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= device::kAttentionMaxGroup &&
         head_dim % 32 == 0 && head_dim >= 32 && head_dim <= 256 &&
         heads / kv_heads * head_dim <= device::kAttentionMaxGroupDims;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& slots, const at::Tensor& positions) {
  const auto device_guard = on_device_of(q);  // [Operands' device]
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "decode_attention: q must be [B, heads, head_dim] and k, v [B, kv_heads, head_dim], the last dimension "
              "contiguous, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(decode_attention_supports(heads, kv_heads, dim, q.scalar_type()), "decode_attention: ", heads,
              " heads over ", kv_heads, " kv heads of ", dim, " in ", q.scalar_type(),
              " are not supported (see decode_attention_supports)");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous() &&
                  keys.size(1) == kv_heads && keys.size(3) == dim,
              "decode_attention: the cache must be two contiguous [slots, ", kv_heads, ", tokens, ", dim,
              "] tensors, got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(slots.dim() == 1 && positions.dim() == 1 && slots.size(0) == q.size(0) &&
                  positions.size(0) == q.size(0) && slots.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "decode_attention: slots and positions must be [", q.size(0), "] int64, got ", slots.sizes(), " ",
              slots.scalar_type(), " and ", positions.sizes(), " ", positions.scalar_type());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &keys, &values, &slots, &positions}) {
    TORCH_CHECK(t->device() == q.device(), "decode_attention: every operand must be on ", q.device(), ", one is on ",
                t->device());
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &keys, &values}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "decode_attention: every operand must be ", q.scalar_type(),
                ", one is ", t->scalar_type());
  }
  TORCH_CHECK(q.is_cuda(), "decode_attention: the operands must be on a GPU, got ", q.device());
  auto out = at::empty({q.size(0), heads, dim}, q.options());
  if (q.size(0) == 0) return out;
  const int64_t sequences = q.size(0), tokens = keys.size(2);
  const int chunks = device::attention_chunks(tokens);
  const auto floats = q.options().dtype(at::kFloat);
  const auto m = at::empty({sequences, heads, chunks}, floats), l = at::empty({sequences, heads, chunks}, floats);
  const auto acc = at::empty({sequences, heads, chunks, dim}, floats);
  const device::AttentionPartials partials{m.data_ptr<float>(), l.data_ptr<float>(), acc.data_ptr<float>(), chunks};
  // decode_attention_supports took the dtype.
  with_cuda_type(q.scalar_type(), [&](auto type) {
    using T = decltype(type);
    const device::AttentionOperands<T> operands{static_cast<const T*>(q.data_ptr()),
                                                {q.stride(0), q.stride(1)},
                                                static_cast<const T*>(k.data_ptr()),
                                                {k.stride(0), k.stride(1)},
                                                static_cast<const T*>(v.data_ptr()),
                                                {v.stride(0), v.stride(1)},
                                                static_cast<T*>(keys.data_ptr()),
                                                static_cast<T*>(values.data_ptr()),
                                                slots.data_ptr<int64_t>(),
                                                positions.data_ptr<int64_t>(),
                                                static_cast<T*>(out.data_ptr()),
                                                sequences,
                                                heads,
                                                kv_heads,
                                                dim,
                                                tokens};
    C10_CUDA_CHECK(device::decode_attention(operands, partials, c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

}  // namespace symbiosis::kernels
