#include "client_runtime/models/config_fields.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/checkpoint.h"

namespace symbiosis::detail {

int64_t required_int(const Checkpoint& ckpt, const std::string& path) {
  auto v = ckpt.config_number(path);
  TORCH_CHECK(v.has_value(), ckpt.dir() / "config.json", ": missing field '", path, "'");
  // Within int64's range before the cast, which is undefined outside it (2^63 is exact in a double).
  TORCH_CHECK(*v == std::floor(*v) && std::fabs(*v) < 9223372036854775808.0, ckpt.dir() / "config.json", ": field '",
              path, "' should be an integer, got ", *v);
  return static_cast<int64_t>(*v);
}

int64_t optional_int(const Checkpoint& ckpt, const std::string& path, int64_t fallback) {
  return ckpt.config_has(path) ? required_int(ckpt, path) : fallback;
}

double number_or_off(const Checkpoint& ckpt, const std::string& name, double fallback) {
  double value = fallback;
  if (auto v = ckpt.config_number(name)) {
    value = *v;
  } else if (const auto config = nlohmann::json::parse(ckpt.config_text(), nullptr, /*allow_exceptions=*/false);
             config.is_object() && config.contains(name)) {
    value = 0.0;  // present, so null
  }
  TORCH_CHECK(value >= 0, ckpt.dir() / "config.json", ": field '", name, "' is ", value,
              ", expected a positive number or null");
  return value;
}

std::vector<double> number_list(const Checkpoint& ckpt, const std::string& path, int64_t length) {
  const auto where = ckpt.dir() / "config.json";
  TORCH_CHECK(ckpt.config_has(path), where, ": missing field '", path, "' (a list of ", length, " numbers)");
  std::vector<double> numbers;
  for (int64_t i = 0; ckpt.config_has(path + "." + std::to_string(i)); ++i) {
    numbers.push_back(*ckpt.config_number(path + "." + std::to_string(i)));
  }
  TORCH_CHECK(static_cast<int64_t>(numbers.size()) == length, where, ": field '", path, "' has ", numbers.size(),
              " numbers, expected ", length);
  return numbers;
}

}  // namespace symbiosis::detail
