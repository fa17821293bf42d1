// The dtypes this project supports, by their safetensors codes and their flag names (declared in
// common/checkpoint.h).
#include "common/checkpoint.h"

#include <c10/util/Exception.h>

namespace symbiosis {

at::ScalarType dtype_from_safetensors(const std::string& code, const std::string& where) {
  if (code == "F32") return at::kFloat;
  if (code == "BF16") return at::kBFloat16;
  if (code == "F16") return at::kHalf;
  TORCH_CHECK(false, where, ": unsupported dtype '", code, "' (expected F32, BF16 or F16)");
}

std::string dtype_to_safetensors(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    default: TORCH_CHECK(false, "unsupported dtype ", dtype, " (expected float32, bfloat16 or float16)");
  }
}

at::ScalarType parse_dtype_name(const std::string& name) {
  if (name == "fp32" || name == "float32" || name == "float") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return at::kHalf;
  TORCH_CHECK(false, "unsupported dtype '", name, "' (expected fp32, bf16 or fp16)");
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "fp32";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    default: return c10::toString(dtype);
  }
}

}  // namespace symbiosis
