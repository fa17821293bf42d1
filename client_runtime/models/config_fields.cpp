#include "client_runtime/models/config_fields.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "common/checkpoint.h"

namespace symbiosis::detail {

void check_model_type(const Checkpoint& ckpt, const std::string& expected) {
  if (auto type = ckpt.config_string("model_type")) {
    TORCH_CHECK(*type == expected, ckpt.dir() / "config.json", ": model_type is '", *type, "', expected '", expected,
                "'");
  }
}

int64_t required_int(const Checkpoint& ckpt, const std::string& path) {
  auto v = ckpt.config_number(path);
  TORCH_CHECK(v.has_value(), ckpt.dir() / "config.json", ": missing field '", path, "'");
  TORCH_CHECK(*v == std::floor(*v), ckpt.dir() / "config.json", ": field '", path, "' should be an integer, got ", *v);
  return static_cast<int64_t>(*v);
}

int64_t optional_int(const Checkpoint& ckpt, const std::string& path, int64_t fallback) {
  return ckpt.config_has(path) ? required_int(ckpt, path) : fallback;
}

}  // namespace symbiosis::detail
