#include "common/checkpoint.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace symbiosis {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A read-only file mapped copy-on-write; tensors keep it alive through their deleters.
class MappedFile {
 public:
  explicit MappedFile(const fs::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY);
    TORCH_CHECK(fd_ >= 0, "checkpoint file ", path, " cannot be opened: ", std::strerror(errno));
    struct stat st {};
    TORCH_CHECK(::fstat(fd_, &st) == 0, "cannot stat ", path);
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      data_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd_, 0);
      TORCH_CHECK(data_ != MAP_FAILED, "cannot mmap ", path, ": ", std::strerror(errno));
    }
  }
  ~MappedFile() {
    if (data_ && data_ != MAP_FAILED) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return static_cast<const char*>(data_); }
  char* mutable_data() { return static_cast<char*>(data_); }
  size_t size() const { return size_; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  int fd_ = -1;
  void* data_ = nullptr;
  size_t size_ = 0;
};

struct Entry {
  TensorRecord record;
  std::shared_ptr<MappedFile> file;
  size_t begin = 0;  // absolute byte offsets in the file
  size_t end = 0;
};

json read_json(const fs::path& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "missing file ", path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "bad JSON in ", path, ": ", e.what());
  }
}

std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream s;
  s << shape;
  return s.str();
}

uint64_t fnv1a(uint64_t h, const std::string& text) {
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

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

class Checkpoint::Impl {
 public:
  fs::path dir;
  std::string config_text;
  json config;
  std::map<std::string, Entry> entries;
  std::string hash;

  void load_file(const fs::path& path) {
    auto file = std::make_shared<MappedFile>(path);
    TORCH_CHECK(file->size() >= 8, "checkpoint file ", path, " is too short to be safetensors");
    uint64_t header_len = 0;
    std::memcpy(&header_len, file->data(), 8);
    TORCH_CHECK(header_len <= file->size() - 8, "checkpoint file ", path,
                ": header length ", header_len, " runs past the end of the file");
    json header;
    try {
      header = json::parse(file->data() + 8, file->data() + 8 + header_len);
    } catch (const json::exception& e) {
      TORCH_CHECK(false, "bad JSON header in ", path, ": ", e.what());
    }
    const size_t data_start = 8 + header_len;
    for (auto& [name, value] : header.items()) {
      if (name == "__metadata__") continue;
      const std::string where = path.string() + ", tensor '" + name + "'";
      TORCH_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") &&
                      value.contains("data_offsets"),
                  where, ": header entry lacks dtype, shape or data_offsets");
      Entry e;
      e.record.name = name;
      e.record.dtype = dtype_from_safetensors(value["dtype"].get<std::string>(), where);
      e.record.shape = value["shape"].get<std::vector<int64_t>>();
      e.record.file = path;
      auto offsets = value["data_offsets"].get<std::vector<size_t>>();
      TORCH_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1], where, ": bad data_offsets");
      e.begin = data_start + offsets[0];
      e.end = data_start + offsets[1];
      TORCH_CHECK(e.end <= file->size(), where, ": data runs past the end of the file");
      int64_t numel = 1;
      for (auto d : e.record.shape) numel *= d;
      TORCH_CHECK(static_cast<size_t>(numel) * at::elementSize(e.record.dtype) == e.end - e.begin,
                  where, ": ", e.end - e.begin, " bytes do not hold shape ", shape_str(e.record.shape));
      e.file = file;
      TORCH_CHECK(!entries.count(name), "tensor '", name, "' appears twice (second time in ", path, ")");
      entries.emplace(name, std::move(e));
    }
  }
};

Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::~Checkpoint() = default;

std::shared_ptr<Checkpoint> Checkpoint::open(const fs::path& dir) {
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  TORCH_CHECK(fs::is_directory(dir), "checkpoint directory ", dir, " does not exist");
  const auto config_path = dir / "config.json";
  impl->config = read_json(config_path);
  TORCH_CHECK(impl->config.is_object(), "bad JSON in ", config_path, ": expected an object");
  impl->config_text = impl->config.dump();
  const auto single = dir / "model.safetensors";
  const auto index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    json j = read_json(index);
    TORCH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "bad index ", index,
                ": expected a \"weight_map\" object");
    std::vector<std::string> shards;
    for (auto& [name, file] : j["weight_map"].items()) shards.push_back(file.get<std::string>());
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
    for (const auto& shard : shards) impl->load_file(dir / shard);
    for (auto& [name, file] : j["weight_map"].items()) {
      TORCH_CHECK(impl->entries.count(name), "index ", index, " names tensor '", name, "' in ",
                  file.get<std::string>(), ", but that file does not hold it");
    }
  } else {
    TORCH_CHECK(fs::exists(single), "missing file ", single, " (and no ", index.filename(), ")");
    impl->load_file(single);
  }
  uint64_t h = 1469598103934665603ull;
  h = fnv1a(h, impl->config_text);
  for (auto& [name, e] : impl->entries) {
    h = fnv1a(h, name + ":" + dtype_to_safetensors(e.record.dtype) + ":" + shape_str(e.record.shape) + ";");
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  impl->hash = buf;
  return std::shared_ptr<Checkpoint>(new Checkpoint(std::move(impl)));
}

const fs::path& Checkpoint::dir() const { return impl_->dir; }
const std::string& Checkpoint::config_text() const { return impl_->config_text; }
const std::string& Checkpoint::model_hash() const { return impl_->hash; }

namespace {
const json* find_path(const json& root, const std::string& path) {
  const json* node = &root;
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '.')) {
    if (node->is_array()) {  // a list's element by its index: "layer_types.3"
      if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos) return nullptr;
      const size_t index = std::stoul(part);
      if (index >= node->size()) return nullptr;
      node = &(*node)[index];
      continue;
    }
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
  }
  return node->is_null() ? nullptr : node;
}
}  // namespace

bool Checkpoint::config_has(const std::string& path) const { return find_path(impl_->config, path) != nullptr; }

std::optional<double> Checkpoint::config_number(const std::string& path) const {
  const json* v = find_path(impl_->config, path);
  if (!v) return std::nullopt;
  TORCH_CHECK(v->is_number(), impl_->dir / "config.json", ": field '", path, "' should be a number, got ", v->dump());
  return v->get<double>();
}

std::optional<std::string> Checkpoint::config_string(const std::string& path) const {
  const json* v = find_path(impl_->config, path);
  if (!v) return std::nullopt;
  TORCH_CHECK(v->is_string(), impl_->dir / "config.json", ": field '", path, "' should be a string, got ", v->dump());
  return v->get<std::string>();
}

std::optional<bool> Checkpoint::config_bool(const std::string& path) const {
  const json* v = find_path(impl_->config, path);
  if (!v) return std::nullopt;
  TORCH_CHECK(v->is_boolean(), impl_->dir / "config.json", ": field '", path, "' should be true or false, got ", v->dump());
  return v->get<bool>();
}

bool Checkpoint::contains(const std::string& name) const { return impl_->entries.count(name) > 0; }

const TensorRecord& Checkpoint::record(const std::string& name) const {
  auto it = impl_->entries.find(name);
  TORCH_CHECK(it != impl_->entries.end(), "checkpoint ", impl_->dir, " is missing tensor '", name, "'");
  return it->second.record;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (auto& [name, e] : impl_->entries) out.push_back(name);
  return out;
}

at::Tensor Checkpoint::tensor(const std::string& name) const {
  auto it = impl_->entries.find(name);
  TORCH_CHECK(it != impl_->entries.end(), "checkpoint ", impl_->dir, " is missing tensor '", name, "'");
  const Entry& e = it->second;
  char* ptr = e.file->mutable_data() + e.begin;
  auto options = at::TensorOptions().dtype(e.record.dtype);
  if (reinterpret_cast<uintptr_t>(ptr) % at::elementSize(e.record.dtype) != 0) {
    // Unaligned data cannot be viewed in place; copy it.
    auto out = at::empty(e.record.shape, options);
    std::memcpy(out.data_ptr(), ptr, e.end - e.begin);
    return out;
  }
  auto keep = e.file;
  return at::from_blob(ptr, e.record.shape, [keep](void*) mutable { keep.reset(); }, options);
}

at::Tensor Checkpoint::tensor(const std::string& name, at::IntArrayRef expected_shape) const {
  const auto& rec = record(name);
  TORCH_CHECK(at::IntArrayRef(rec.shape) == expected_shape, rec.file, ": tensor '", name, "' has shape ",
              shape_str(rec.shape), ", expected ", shape_str(expected_shape));
  return tensor(name);
}

void write_safetensors(const fs::path& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  size_t offset = 0;
  for (auto& [name, t] : tensors) {
    const size_t bytes = t.numel() * t.element_size();
    header[name] = {{"dtype", dtype_to_safetensors(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // keeps the data 8-byte aligned
  std::ofstream out(file, std::ios::binary);
  TORCH_CHECK(out.good(), "cannot write ", file);
  uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(text.data(), text.size());
  for (auto& [name, t] : tensors) {
    auto c = t.detach().to(at::kCPU).contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  }
  TORCH_CHECK(out.good(), "failed writing ", file);
}

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
    header[e.name] = {{"dtype", dtype_to_safetensors(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
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
  TORCH_CHECK(name == e.name, "safetensors file ", impl_->file, ": expected tensor '", e.name, "' next, got '", name, "'");
  TORCH_CHECK(tensor.scalar_type() == e.dtype && tensor.sizes() == at::IntArrayRef(e.shape), "safetensors file ",
              impl_->file, ": tensor '", name, "' is ", tensor.scalar_type(), tensor.sizes(), ", listed as ", e.dtype,
              shape_str(e.shape));
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

}  // namespace symbiosis
