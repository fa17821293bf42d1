#include "tests/test_util.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <mutex>

namespace symbiosis::testing {

std::filesystem::path temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp failed for ", pattern);
  return pattern;
}

std::string binary(const std::string& relative) { return std::string(SYMBIOSIS_BINARY_DIR) + "/" + relative; }

std::filesystem::path make_checkpoint(const std::string& preset, const std::string& extra_args) {
  static std::mutex mutex;
  static std::map<std::string, std::filesystem::path> made;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = preset + "|" + extra_args;
  if (auto it = made.find(key); it != made.end()) return it->second;
  auto dir = temp_dir("symbiosis-" + preset) / "model";
  const std::string command = binary("tools/symbiosis-make-checkpoint") + " --preset " + preset + " --out " +
                              dir.string() + " " + extra_args + " > /dev/null";
  TORCH_CHECK(std::system(command.c_str()) == 0, "failed: ", command);
  made[key] = dir;
  return dir;
}

std::unique_ptr<Executor> start_executor(const std::filesystem::path& model, ExecutorOptions options) {
  options.model_dir = model;
  options.listen = "tcp://127.0.0.1:*";
  return Executor::start(options);
}

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  auto a64 = a.detach().to(at::kDouble);
  auto b64 = b.detach().to(at::kDouble);
  TORCH_CHECK(a64.sizes() == b64.sizes(), "shapes differ: ", a64.sizes(), " vs ", b64.sizes());
  const double scale = b64.abs().max().item<double>();
  const double diff = (a64 - b64).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

}  // namespace symbiosis::testing
