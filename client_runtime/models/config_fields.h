#pragma once
// Internal to the models (not installed): the fields of a checkpoint's config.json that a model's
// config (LlamaConfig, GPT2Config) is read from, with errors that name config.json and the field.
#include <cstdint>
#include <string>
#include <vector>

namespace symbiosis {

class Checkpoint;

namespace detail {

// The whole number at `path` (dotted, as Checkpoint::config_number takes it); throws naming the
// field when it is missing (or null) or not a whole number.
int64_t required_int(const Checkpoint& ckpt, const std::string& path);
// The same, or `fallback` when the field is missing or null.
int64_t optional_int(const Checkpoint& ckpt, const std::string& path, int64_t fallback);
// The number at top-level field `name`: `fallback` when the field is missing, 0 when it is null
// (a setting that null turns off, as Gemma 2's soft caps); throws naming the field when negative.
double number_or_off(const Checkpoint& ckpt, const std::string& name, double fallback);
// The list of `length` numbers at `path`; throws naming the field when it is missing, not a list of
// numbers, or of another length.
std::vector<double> number_list(const Checkpoint& ckpt, const std::string& path, int64_t length);

}  // namespace detail
}  // namespace symbiosis
