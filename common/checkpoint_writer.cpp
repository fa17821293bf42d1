// Writing safetensors files: SafetensorsWriter, tensor by tensor; write_safetensors, at once.
#include "common/checkpoint.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>

namespace symbiosis {
namespace fs = std::filesystem;
using nlohmann::json;

class SafetensorsWriter::Impl {
 public:
  fs::path file;
  std::vector<Entry> entries;
  size_t next = 0;
  std::ofstream out;
};

size_t SafetensorsWriter::data_bytes(const Entry& entry) {
  size_t n = at::elementSize(entry.dtype);
  for (auto d : entry.shape) n *= static_cast<size_t>(d);
  return n;
}

SafetensorsWriter::SafetensorsWriter(const fs::path& file, std::vector<Entry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->file = file;
  impl_->entries = std::move(entries);
  json header = json::object();
  size_t offset = 0;
  for (const auto& e : impl_->entries) {
    TORCH_CHECK(!header.contains(e.name), "safetensors file ", file, ": tensor '", e.name, "' listed twice");
    const size_t bytes = data_bytes(e);
    header[e.name] = {
        {"dtype", dtype_to_safetensors(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // keeps the data 8-byte aligned
  impl_->out.open(file, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(impl_->out.good(), "cannot write ", file);
  uint64_t len = text.size();
  impl_->out.write(reinterpret_cast<const char*>(&len), 8);
  impl_->out.write(text.data(), text.size());
  TORCH_CHECK(impl_->out.good(), "failed writing ", file);
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  TORCH_CHECK(impl_->next < impl_->entries.size(), "safetensors file ", impl_->file, ": tensor '", name,
              "' is one more than the ", impl_->entries.size(), " listed");
  const Entry& e = impl_->entries[impl_->next];
  TORCH_CHECK(name == e.name, "safetensors file ", impl_->file, ": expected tensor '", e.name, "' next, got '", name,
              "'");
  TORCH_CHECK(tensor.scalar_type() == e.dtype && tensor.sizes() == at::IntArrayRef(e.shape), "safetensors file ",
              impl_->file, ": tensor '", name, "' is ", tensor.scalar_type(), tensor.sizes(), ", listed as ", e.dtype,
              at::IntArrayRef(e.shape));
  auto c = tensor.detach().to(at::kCPU).contiguous();
  impl_->out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(data_bytes(e)));
  TORCH_CHECK(impl_->out.good(), "failed writing ", impl_->file);
  ++impl_->next;
}

void SafetensorsWriter::finish() {
  TORCH_CHECK(impl_->next == impl_->entries.size(), "safetensors file ", impl_->file, ": ", impl_->next, " of ",
              impl_->entries.size(), " tensors written");
  impl_->out.close();
  TORCH_CHECK(!impl_->out.fail(), "failed closing ", impl_->file);
}

void write_safetensors(const fs::path& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter writer(file, std::move(entries), metadata);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  writer.finish();
}

}  // namespace symbiosis
