#include "common/checkpoint.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sodium.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

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

// [Weight hash]
// The model hash identifies a model by what it computes: config.json, the tensor table (names,
// dtypes, shapes) and every tensor's bytes, so that a base and a fine-tuned base of the same shape
// are two models to the client, the executor and a resumed trainer alike. It is BLAKE2b
// (libsodium's crypto_generichash) over the config, then each tensor in name order with its own
// digest; a tensor's digest is BLAKE2b over its size and the digests of its kWeightHashChunk-byte
// chunks, so one file's bytes are hashed by every core at once and the hash does not depend on how
// the tensors are spread over shards or laid out in a file. Reading a large checkpoint's bytes
// takes seconds, so the tensors' digests are kept beside the checkpoint in kDigestCacheName, per
// weight file, keyed by the file's size, modification and change times and inode: a file that
// changed is hashed again. Where the checkpoint's directory is not writable the cache lies in the
// user's cache directory ($XDG_CACHE_HOME/symbiosis/model-hash/, else ~/.cache/...), named by a
// digest of the directory's absolute path. A cache that cannot be read or written is only slower.
constexpr size_t kWeightHashChunk = size_t{64} << 20;
constexpr size_t kDigestBytes = crypto_generichash_BYTES;  // 32
constexpr size_t kModelHashBytes = 16;                     // 32 hex digits in messages
constexpr const char* kDigestCacheName = ".symbiosis-model-hash.json";
constexpr const char* kDigestCacheFormat = "symbiosis-weight-digests-1";
// Read once, here: where the per-user cache lies.
constexpr const char* kCacheHomeVariable = "XDG_CACHE_HOME";
constexpr const char* kHomeVariable = "HOME";

using Digest = std::array<unsigned char, kDigestBytes>;

std::string to_hex(const unsigned char* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(digits[bytes[i] >> 4]);
    out.push_back(digits[bytes[i] & 15]);
  }
  return out;
}

// A streaming BLAKE2b; Update takes text or raw bytes, each framed by its length.
class Blake2b {
 public:
  explicit Blake2b(size_t out_bytes = kDigestBytes) : out_bytes_(out_bytes) {
    TORCH_CHECK(sodium_init() >= 0, "libsodium could not be initialized");
    crypto_generichash_init(&state_, nullptr, 0, out_bytes_);
  }
  void raw(const void* data, size_t n) {
    crypto_generichash_update(&state_, static_cast<const unsigned char*>(data), n);
  }
  void framed(const void* data, size_t n) {
    const uint64_t len = n;
    raw(&len, sizeof len);
    raw(data, n);
  }
  void framed(const std::string& text) { framed(text.data(), text.size()); }
  std::string hex() {
    std::vector<unsigned char> out(out_bytes_);
    crypto_generichash_final(&state_, out.data(), out_bytes_);
    return to_hex(out.data(), out_bytes_);
  }

 private:
  size_t out_bytes_;
  crypto_generichash_state state_;
};

// The digests of tensors' bytes, [Weight hash]: every chunk of every tensor shared among threads.
std::vector<std::string> tensor_digests(const std::vector<std::pair<const char*, size_t>>& tensors) {
  struct Chunk {
    size_t tensor;
    const char* data;
    size_t bytes;
  };
  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk(tensors.size() + 1, 0);
  size_t total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    first_chunk[t] = chunks.size();
    const auto [data, bytes] = tensors[t];
    for (size_t at = 0; at < bytes || (at == 0 && bytes == 0); at += kWeightHashChunk) {
      chunks.push_back({t, data + at, std::min(kWeightHashChunk, bytes - at)});
      if (bytes == 0) break;
    }
    total += bytes;
  }
  first_chunk[tensors.size()] = chunks.size();
  TORCH_CHECK(sodium_init() >= 0, "libsodium could not be initialized");
  std::vector<Digest> chunk_digests(chunks.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < chunks.size(); i = next++) {
      crypto_generichash(chunk_digests[i].data(), kDigestBytes, reinterpret_cast<const unsigned char*>(chunks[i].data),
                         chunks[i].bytes, nullptr, 0);
    }
  };
  const size_t threads = std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()), chunks.size(),
                                           1 + total / kWeightHashChunk});
  std::vector<std::thread> pool;
  for (size_t i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& thread : pool) thread.join();
  std::vector<std::string> out;
  for (size_t t = 0; t < tensors.size(); ++t) {
    Blake2b h;
    const uint64_t bytes = tensors[t].second;
    h.raw(&bytes, sizeof bytes);
    for (size_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) h.raw(chunk_digests[c].data(), kDigestBytes);
    out.push_back(h.hex());
  }
  return out;
}

// What a weight file's cache entry is keyed by: any write or replacement changes one of these.
json file_identity(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return json();
  auto ns = [](const timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; };
  return {{"size", static_cast<uint64_t>(st.st_size)},
          {"mtime_ns", ns(st.st_mtim)},
          {"ctime_ns", ns(st.st_ctim)},
          {"inode", static_cast<uint64_t>(st.st_ino)},
          {"device", static_cast<uint64_t>(st.st_dev)}};
}

// Where the digests of the checkpoint in dir may be kept, in the order they are tried.
std::vector<fs::path> digest_cache_files(const fs::path& dir) {
  std::vector<fs::path> out{dir / kDigestCacheName};
  fs::path home;
  if (const char* cache = std::getenv(kCacheHomeVariable); cache && *cache) {
    home = cache;
  } else if (const char* user = std::getenv(kHomeVariable); user && *user) {
    home = fs::path(user) / ".cache";
  }
  if (!home.empty()) {
    std::error_code ec;
    const auto absolute = fs::weakly_canonical(fs::absolute(dir, ec), ec);
    Blake2b h(kModelHashBytes);
    h.framed(absolute.string());
    out.push_back(home / "symbiosis" / "model-hash" / (h.hex() + ".json"));
  }
  return out;
}

json read_digest_cache(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return json();
  std::ifstream in(file);
  if (!in) return json();
  try {
    json j = json::parse(in);
    if (j.is_object() && j.value("format", "") == kDigestCacheFormat && j.contains("files") &&
        j["files"].is_object()) {
      return j;
    }
  } catch (const std::exception&) {
    // A damaged or unreadable cache is recomputed.
  }
  return json();
}

// Written whole to a temporary file, then renamed: a reader sees the old cache or the new one.
bool write_digest_cache(const fs::path& file, const json& cache) {
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  // Unique per process and thread: an executor and a client in one process may both write it.
  static std::atomic<uint64_t> writes{0};
  const auto temporary = file.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(writes++);
  {
    std::ofstream out(temporary, std::ios::trunc);
    if (!out) return false;
    out << cache.dump(1) << "\n";
    if (!out.good()) {
      fs::remove(temporary, ec);
      return false;
    }
  }
  fs::rename(temporary, file, ec);
  if (!ec) return true;
  fs::remove(temporary, ec);
  return false;
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
    TORCH_CHECK(header.is_object(), "bad JSON header in ", path, ": expected an object of tensors");
    const size_t data_start = 8 + header_len;
    const uint64_t data_bytes = file->size() - data_start;
    for (auto& [name, value] : header.items()) {
      if (name == "__metadata__") continue;
      const std::string where = path.string() + ", tensor '" + name + "'";
      TORCH_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") &&
                      value.contains("data_offsets"),
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
        TORCH_CHECK(false, where, ": dtype should be a string, shape and data_offsets lists of whole numbers: ",
                    error.what());
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
                    shape_str(e.record.shape), " does not fit the file");
        bytes *= static_cast<uint64_t>(d);
      }
      TORCH_CHECK(bytes == e.end - e.begin, where, ": ", e.end - e.begin, " bytes do not hold shape ",
                  shape_str(e.record.shape));
      e.file = file;
      TORCH_CHECK(!entries.count(name), "tensor '", name, "' appears twice (second time in ", path, ")");
      entries.emplace(name, std::move(e));
    }
  }

  // [Weight hash]: the tensors' digests from the cache where their file is unchanged, else
  // computed (and the cache rewritten); then the model hash over the config and the table.
  std::string compute_model_hash() const {
    std::map<fs::path, std::vector<const Entry*>> by_file;  // each file's tensors, in name order
    for (const auto& [name, e] : entries) by_file[e.record.file].push_back(&e);
    const auto cache_files = digest_cache_files(dir);
    std::vector<json> caches;
    for (const auto& file : cache_files) caches.push_back(read_digest_cache(file));

    std::map<std::string, std::string> digests;  // tensor name -> hex digest
    json files = json::object();                 // the cache as it will be written
    std::vector<std::pair<const char*, size_t>> to_hash;
    std::vector<const Entry*> hashed;
    for (const auto& [file, file_entries] : by_file) {
      const std::string key = file.lexically_relative(dir).string();
      const json identity = file_identity(file);
      const json* cached = nullptr;
      for (const auto& cache : caches) {
        if (cache.is_null() || !cache["files"].contains(key)) continue;
        const json& entry = cache["files"][key];
        if (!entry.is_object() || entry.value("identity", json()) != identity) continue;
        const json& tensors = entry.value("tensors", json());
        const bool complete = tensors.is_object() && std::all_of(file_entries.begin(), file_entries.end(), [&](auto* e) {
          return tensors.contains(e->record.name) && tensors[e->record.name].is_string();
        });
        if (complete) {
          cached = &entry;
          break;
        }
      }
      json tensors = json::object();
      for (const Entry* e : file_entries) {
        if (cached) {
          tensors[e->record.name] = digests[e->record.name] = (*cached)["tensors"][e->record.name].get<std::string>();
        } else {
          to_hash.emplace_back(e->file->data() + e->begin, e->end - e->begin);
          hashed.push_back(e);
        }
      }
      files[key] = {{"identity", identity}, {"tensors", tensors}};
    }
    if (!hashed.empty()) {
      const auto computed = tensor_digests(to_hash);
      for (size_t i = 0; i < hashed.size(); ++i) {
        const auto& name = hashed[i]->record.name;
        digests[name] = computed[i];
        const std::string key = hashed[i]->record.file.lexically_relative(dir).string();
        files[key]["tensors"][name] = computed[i];
      }
      const json cache = {{"format", kDigestCacheFormat}, {"files", files}};
      for (const auto& file : cache_files) {
        if (write_digest_cache(file, cache)) break;
      }
    }

    Blake2b h(kModelHashBytes);
    h.framed(std::string("symbiosis-model-2"));
    h.framed(config_text);
    for (const auto& [name, e] : entries) {
      h.framed(name);
      h.framed(dtype_to_safetensors(e.record.dtype));
      h.framed(shape_str(e.record.shape));
      h.framed(digests.at(name));
    }
    return h.hex();
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
      TORCH_CHECK(impl->entries.count(name), "index ", index, " names tensor '", name, "' in ",
                  file.get<std::string>(), ", but that file does not hold it");
    }
  } else {
    TORCH_CHECK(fs::exists(single), "missing file ", single, " (and no ", index.filename(), ")");
    impl->load_file(single);
  }
  impl->hash = impl->compute_model_hash();
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
