#include "common/weight_hash.h"

#include <c10/util/Exception.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <utility>

namespace symbiosis {
namespace fs = std::filesystem;
using nlohmann::json;

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

namespace {

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
  const size_t threads = std::min<size_t>(
      {std::max(1u, std::thread::hardware_concurrency()), chunks.size(), 1 + total / kWeightHashChunk});
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
    if (j.is_object() && j.value("format", "") == kDigestCacheFormat && j.contains("files") && j["files"].is_object()) {
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

// The tensor's shape as the hash reads it: "[2, 3]".
std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << at::IntArrayRef(shape);
  return s.str();
}

}  // namespace

std::string compute_model_hash(const fs::path& dir, const std::string& config_text,
                               const std::vector<HashedTensor>& tensors) {
  std::map<fs::path, std::vector<const HashedTensor*>> by_file;  // each file's tensors, in name order
  for (const auto& t : tensors) by_file[t.record->file].push_back(&t);
  const auto cache_files = digest_cache_files(dir);
  std::vector<json> caches;
  for (const auto& file : cache_files) caches.push_back(read_digest_cache(file));

  std::map<std::string, std::string> digests;  // tensor name -> hex digest
  json files = json::object();                 // the cache as it will be written
  std::vector<std::pair<const char*, size_t>> to_hash;
  std::vector<const HashedTensor*> hashed;
  for (const auto& [file, file_tensors] : by_file) {
    const std::string key = file.lexically_relative(dir).string();
    const json identity = file_identity(file);
    const json* cached = nullptr;
    for (const auto& cache : caches) {
      if (cache.is_null() || !cache["files"].contains(key)) continue;
      const json& entry = cache["files"][key];
      if (!entry.is_object() || entry.value("identity", json()) != identity) continue;
      const json& entry_tensors = entry.value("tensors", json());
      const bool complete =
          entry_tensors.is_object() && std::all_of(file_tensors.begin(), file_tensors.end(), [&](auto* t) {
            return entry_tensors.contains(t->record->name) && entry_tensors[t->record->name].is_string();
          });
      if (complete) {
        cached = &entry;
        break;
      }
    }
    json file_digests = json::object();
    for (const HashedTensor* t : file_tensors) {
      if (cached) {
        file_digests[t->record->name] = digests[t->record->name] =
            (*cached)["tensors"][t->record->name].get<std::string>();
      } else {
        to_hash.emplace_back(t->data, t->bytes);
        hashed.push_back(t);
      }
    }
    files[key] = {{"identity", identity}, {"tensors", file_digests}};
  }
  if (!hashed.empty()) {
    const auto computed = tensor_digests(to_hash);
    for (size_t i = 0; i < hashed.size(); ++i) {
      const auto& name = hashed[i]->record->name;
      digests[name] = computed[i];
      const std::string key = hashed[i]->record->file.lexically_relative(dir).string();
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
  for (const auto& t : tensors) {
    const auto& name = t.record->name;
    h.framed(name);
    h.framed(dtype_to_safetensors(t.record->dtype));
    h.framed(shape_text(t.record->shape));
    h.framed(digests.at(name));
  }
  return h.hex();
}

}  // namespace symbiosis
