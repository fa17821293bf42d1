#pragma once
// Hugging Face checkpoints: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json. Tensors are memory-mapped, not copied; fp32, bf16 and fp16.
// Every error is a c10::Error whose message names the file and what is wrong.
// Thread safety: a Checkpoint is immutable after open(); concurrent reads are safe.
#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace symbiosis {

struct TensorRecord {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::filesystem::path file;
};

class Checkpoint {
 public:
  static std::shared_ptr<Checkpoint> open(const std::filesystem::path& dir);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::filesystem::path& dir() const;
  // config.json, whole; and typed look-ups by dotted path ("rope_scaling.factor").
  const std::string& config_text() const;
  std::optional<double> config_number(const std::string& path) const;
  std::optional<std::string> config_string(const std::string& path) const;
  std::optional<bool> config_bool(const std::string& path) const;
  bool config_has(const std::string& path) const;

  bool contains(const std::string& name) const;
  const TensorRecord& record(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  // The tensor, memory-mapped (copy-on-write). Throws naming the file when it is missing.
  at::Tensor tensor(const std::string& name) const;
  // The same, checked against the shape the model expects.
  at::Tensor tensor(const std::string& name, at::IntArrayRef expected_shape) const;

  // A hash of config.json, the tensor table (names, dtypes, shapes) and the weights' bytes, read
  // once: their digests are cached beside the checkpoint ([Weight hash] in common/weight_hash.cpp).
  const std::string& model_hash() const;

 private:
  class Impl;
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes one safetensors file (tensors contiguous, in the given order).
void write_safetensors(const std::filesystem::path& file,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes one safetensors file tensor by tensor, so a file larger than memory can be produced:
// the table (names, dtypes, shapes, in file order) is fixed up front and written first; then
// write() takes each tensor once, in that order; finish() checks that all came and closes the file.
// Not thread-safe. A writer destroyed before finish() leaves an incomplete file behind.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::filesystem::path& file, std::vector<Entry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next tensor; its name, dtype and shape must be the next entry's.
  void write(const std::string& name, const at::Tensor& tensor);
  void finish();
  // Bytes of tensor data one entry takes.
  static size_t data_bytes(const Entry& entry);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// "F32" <-> at::kFloat and so on; throws for a dtype this project does not support.
at::ScalarType dtype_from_safetensors(const std::string& code, const std::string& where);
std::string dtype_to_safetensors(at::ScalarType dtype);
// "fp32" | "bf16" | "fp16" (also "float32", "bfloat16", "float16").
at::ScalarType parse_dtype_name(const std::string& name);
std::string dtype_name(at::ScalarType dtype);

}  // namespace symbiosis
