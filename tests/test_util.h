#pragma once
// Shared set-up for tests: temporary directories, random checkpoints made by the project's
// tool, an in-process executor on a free loopback port, and relative comparisons.
#include <ATen/ATen.h>

#include <filesystem>
#include <memory>
#include <string>
#include <sys/types.h>
#include <vector>

#include "base_executor/executor.h"

namespace symbiosis::testing {

std::filesystem::path temp_dir(const std::string& prefix);
// Runs symbiosis-make-checkpoint --preset PRESET (cached per process).
std::filesystem::path make_checkpoint(const std::string& preset, const std::string& extra_args = "");
std::unique_ptr<Executor> start_executor(const std::filesystem::path& model, ExecutorOptions options = {});
// max|a - b| / max|b|
double relative_error(const at::Tensor& a, const at::Tensor& b);
std::string binary(const std::string& relative);  // a path under the build directory
// Spawns a program with arguments (stdout and stderr inherited); returns its pid.
pid_t spawn(const std::vector<std::string>& args);
// Waits for a spawned program; true when it exited 0.
bool exited_ok(pid_t pid);

}  // namespace symbiosis::testing
