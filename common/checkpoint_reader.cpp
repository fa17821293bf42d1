// Reading a checkpoint: config.json, the safetensors files' tables, their tensors memory-mapped.
#include "common/checkpoint.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/weight_hash.h"

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

}  // namespace

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
    TORCH_CHECK(header_len <= file->size() - 8, "checkpoint file ", path, ": header length ", header_len,
                " runs past the end of the file");
    json header;
    try {
      header = json::parse(file->data() + 8, file->data() + 8 + header_len);
    } catch (const json::exception& e) {
      TORCH_CHECK(false, "bad JSON header in ", path, ": ", e.what());
    }
    TORCH_CHECK(header.is_object(), "bad JSON header in ", path, ": expected an object of tensors");
    const size_t data_start = 8 + header_len;
    const uint64_t data_bytes = file->size() - data_start;
    for (auto& [name, value] : header.items()) {
      if (name == "__metadata__") continue;
      const std::string where = path.string() + ", tensor '" + name + "'";
      TORCH_CHECK(
          value.is_object() && value.contains("dtype") && value.contains("shape") && value.contains("data_offsets"),
          where, ": header entry lacks dtype, shape or data_offsets");
      Entry e;
      e.record.name = name;
      e.record.file = path;
      std::vector<uint64_t> offsets;
      try {
        e.record.dtype = dtype_from_safetensors(value["dtype"].get<std::string>(), where);
        e.record.shape = value["shape"].get<std::vector<int64_t>>();
        offsets = value["data_offsets"].get<std::vector<uint64_t>>();
      } catch (const json::exception& error) {
        TORCH_CHECK(false, where,
                    ": dtype should be a string, shape and data_offsets lists of whole numbers: ", error.what());
      }
      // Offsets and sizes are compared with the file's bytes before any sum or product, which a
      // file's numbers could otherwise overflow.
      TORCH_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_bytes, where,
                  ": bad data_offsets (expected [begin, end] within the file's ", data_bytes, " data bytes)");
      e.begin = data_start + offsets[0];
      e.end = data_start + offsets[1];
      uint64_t bytes = at::elementSize(e.record.dtype);
      for (const int64_t d : e.record.shape) {
        TORCH_CHECK(d >= 0 && (d == 0 || bytes <= data_bytes / static_cast<uint64_t>(d)), where, ": shape ",
                    at::IntArrayRef(e.record.shape), " does not fit the file");
        bytes *= static_cast<uint64_t>(d);
      }
      TORCH_CHECK(bytes == e.end - e.begin, where, ": ", e.end - e.begin, " bytes do not hold shape ",
                  at::IntArrayRef(e.record.shape));
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
    for (auto& [name, file] : j["weight_map"].items()) {
      // A shard is a file of this folder: a name, never a path out of it.
      TORCH_CHECK(file.is_string() && !file.get<std::string>().empty() &&
                      fs::path(file.get<std::string>()).filename() == file.get<std::string>() &&
                      file.get<std::string>() != "." && file.get<std::string>() != "..",
                  "bad index ", index, ": tensor '", name, "' is in ", file.dump(),
                  ", expected the name of a file in the checkpoint's folder");
      shards.push_back(file.get<std::string>());
    }
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
    for (const auto& shard : shards) impl->load_file(dir / shard);
    for (auto& [name, file] : j["weight_map"].items()) {
      TORCH_CHECK(impl->entries.count(name), "index ", index, " names tensor '", name, "' in ", file.get<std::string>(),
                  ", but that file does not hold it");
    }
  } else {
    TORCH_CHECK(fs::exists(single), "missing file ", single, " (and no ", index.filename(), ")");
    impl->load_file(single);
  }
  // [Weight hash] (weight_hash.cpp): over the config and every tensor, in name order.
  std::vector<HashedTensor> hashed;
  for (const auto& [name, e] : impl->entries) hashed.push_back({&e.record, e.file->data() + e.begin, e.end - e.begin});
  impl->hash = compute_model_hash(dir, impl->config_text, hashed);
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
  TORCH_CHECK(v->is_boolean(), impl_->dir / "config.json", ": field '", path, "' should be true or false, got ",
              v->dump());
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
  return at::from_blob(
      ptr, e.record.shape, [keep](void*) mutable { keep.reset(); }, options);
}

at::Tensor Checkpoint::tensor(const std::string& name, at::IntArrayRef expected_shape) const {
  const auto& rec = record(name);
  TORCH_CHECK(at::IntArrayRef(rec.shape) == expected_shape, rec.file, ": tensor '", name, "' has shape ",
              at::IntArrayRef(rec.shape), ", expected ", expected_shape);
  return tensor(name);
}

}  // namespace symbiosis
