#include "bench/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace fs = std::filesystem;

namespace symbiosis::bench {

fs::path build_dir() {
  // The nearest folder above this program that holds the executor (bench/ and tests/*/ alike).
  const auto exe = fs::read_symlink("/proc/self/exe");
  for (auto dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
    if (fs::exists(dir / "base_executor" / "symbiosis-executor")) return dir;
  }
  return exe.parent_path().parent_path();
}

namespace {
std::vector<std::string> set_here;  // names of variables set_for_this_process set, each "NAME="
}  // namespace

void set_for_this_process(const char* name, const char* value) {
  if (std::getenv(name) != nullptr) return;
  setenv(name, value, /*overwrite=*/0);
  set_here.push_back(std::string(name) + "=");
}

pid_t spawn(const std::vector<std::string>& args, const fs::path& stdout_file, const fs::path& stderr_file) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  std::vector<char*> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const auto ours = [&](const std::string& prefix) { return std::strncmp(*e, prefix.data(), prefix.size()) == 0; };
    if (std::none_of(set_here.begin(), set_here.end(), ours)) env.push_back(*e);
  }
  env.push_back(nullptr);
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + args[0] + ": " + std::strerror(rc));
  return pid;
}

bool wait_ok(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool exited(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, WNOHANG) == pid;
}

namespace {
// A "NAME:  N kB" line of /proc/PID/status, in bytes.
size_t status_bytes(pid_t pid, const std::string& name) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(name + ":", 0) == 0) return std::stoull(line.substr(name.size() + 1)) * 1024;
  }
  return 0;
}
}  // namespace

size_t peak_rss_bytes(pid_t pid) { return status_bytes(pid, "VmHWM"); }
size_t resident_bytes(pid_t pid) { return status_bytes(pid, "VmRSS"); }

double gpu_memory_mib(int gpu, const std::string& what) {
  if (gpu < 0) return 0;
  const std::string command =
      "nvidia-smi --query-gpu=" + what + " --format=csv,noheader,nounits -i " + std::to_string(gpu) + " 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return 0;
  double mib = 0;
  if (std::fscanf(pipe, "%lf", &mib) != 1) mib = 0;
  ::pclose(pipe);
  return mib;
}

int gpu_index(const std::string& device) {
  if (device.rfind("cuda", 0) != 0) return -1;
  const auto colon = device.find(':');
  return colon == std::string::npos ? 0 : std::stoi(device.substr(colon + 1));
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> wait_ready(pid_t pid, const fs::path& out_file, int count, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<std::string> endpoints;
  while (true) {
    endpoints.clear();
    std::ifstream out(out_file);
    // A line counts once it is whole: the executor writes it with its newline at once.
    for (std::string line; static_cast<int>(endpoints.size()) < count && std::getline(out, line) && !out.eof();) {
      if (line.rfind("ready ", 0) == 0) endpoints.push_back(line.substr(6));
    }
    if (static_cast<int>(endpoints.size()) == count || exited(pid) || std::chrono::steady_clock::now() > deadline) {
      return endpoints;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

ExecutorProcess start_executor(const std::vector<std::string>& args, const fs::path& dir, int timeout_s) {
  fs::create_directories(dir);
  std::vector<std::string> all = {(build_dir() / "base_executor/symbiosis-executor").string()};
  all.insert(all.end(), args.begin(), args.end());
  ExecutorProcess executor;
  executor.pid = spawn(all, dir / "executor.out", dir / "executor.err");
  const auto started = std::chrono::steady_clock::now();
  const auto endpoints = wait_ready(executor.pid, dir / "executor.out", 1, timeout_s * 1000);
  if (endpoints.empty()) {
    // Back before the deadline: wait_ready saw it exit (and reaped it).
    const bool gone = std::chrono::steady_clock::now() - started < std::chrono::seconds(timeout_s);
    if (!gone) {
      kill(executor.pid, SIGKILL);
      waitpid(executor.pid, nullptr, 0);
    }
    throw std::runtime_error((gone ? std::string("the executor exited before it was ready")
                                   : "the executor was not ready within " + std::to_string(timeout_s) + " s") +
                             " (" + (dir / "executor.err").string() + "): " + read_file(dir / "executor.err"));
  }
  executor.endpoint = endpoints.front();
  return executor;
}

void stop(pid_t pid) {
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
}

}  // namespace symbiosis::bench
