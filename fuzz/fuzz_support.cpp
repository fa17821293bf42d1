#include "fuzz/fuzz_support.h"

#include <unistd.h>

#include <fstream>
#include <sstream>

#include <google/protobuf/stubs/logging.h>

#include "base_executor/base_model.h"
#include "common/checkpoint.h"

namespace symbiosis::fuzz {
namespace fs = std::filesystem;

std::vector<std::string_view> split_parts(const uint8_t* data, size_t size, size_t max_parts) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = rest.find(kPartMarker);
    if (at == std::string_view::npos) break;
    parts.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kPartMarker.size());
  }
  parts.push_back(rest);
  return parts;
}

const fs::path& process_dir() {
  static const fs::path dir = [] {
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    auto path = base / ("symbiosis-fuzz-" + std::to_string(::getpid()));
    fs::create_directories(path);
    // Removed when the process exits normally (libFuzzer's -runs, the replay program).
    static struct Remover {
      fs::path path;
      ~Remover() {
        std::error_code ec;
        fs::remove_all(path, ec);
      }
    } remover{path};
    return path;
  }();
  return dir;
}

const fs::path& fresh_scratch_dir() {
  static const fs::path dir = [] {
    auto path = process_dir() / "input";
    fs::create_directories(path);
    return path;
  }();
  for (const auto& entry : fs::directory_iterator(dir)) fs::remove_all(entry.path());
  return dir;
}

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string join_parts(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += kPartMarker;
    out += parts[i];
  }
  return out;
}

const BaseModel& small_base_model() {
  static const std::unique_ptr<BaseModel> model = [] {
    const auto dir = process_dir() / "base_model";
    fs::create_directories(dir);
    write_file(dir / "config.json", R"({"model_type": "llama"})");
    auto weight = [](int64_t out, int64_t in) { return at::randn({out, in}); };
    const std::string prefix = "model.layers.0.self_attn.";
    write_safetensors(dir / "model.safetensors", {{prefix + "q_proj.weight", weight(8, 4)},
                                                  {prefix + "k_proj.weight", weight(4, 4)},
                                                  {prefix + "v_proj.weight", weight(4, 4)},
                                                  {prefix + "o_proj.weight", weight(4, 8)},
                                                  {prefix + "o_proj.bias", at::randn({4})}});
    return BaseModel::load(*Checkpoint::open(dir), BaseLayerRule{}, at::kCPU, std::nullopt);
  }();
  return *model;
}

}  // namespace symbiosis::fuzz

// libFuzzer calls this once before fuzzing: with SYMBIOSIS_FUZZ_WRITE_SEEDS set, the program
// writes its seed inputs there and exits (what the replay program's --write-seeds does).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Protobuf logs every string field of invalid UTF-8 it parses: millions of lines here.
  google::protobuf::SetLogHandler(nullptr);
  if (const char* dir = std::getenv("SYMBIOSIS_FUZZ_WRITE_SEEDS"); dir && *dir) {
    std::filesystem::create_directories(dir);
    symbiosis::fuzz::write_seeds(dir);
    std::exit(0);
  }
  return 0;
}
