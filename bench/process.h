#pragma once
// Processes for the benchmark programs: start a program with its output in files, wait for it,
// start an executor and wait for its "ready ENDPOINT" line, read a process's peak and resident
// memory and a GPU's memory in use.
#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace symbiosis::bench {

// The build directory: the nearest folder above the running program that holds the executor.
std::filesystem::path build_dir();

// Sets environment variable `name` to `value` for this process alone, unless it is set already: the
// processes spawn() starts get the environment without it.
void set_for_this_process(const char* name, const char* value);
pid_t spawn(const std::vector<std::string>& args, const std::filesystem::path& stdout_file,
            const std::filesystem::path& stderr_file);
bool wait_ok(pid_t pid);  // true when it exited 0
bool exited(pid_t pid);   // true when it has ended (and is reaped: not for wait_ok after)
size_t peak_rss_bytes(pid_t pid);
size_t resident_bytes(pid_t pid);  // VmRSS now
// One nvidia-smi reading of GPU `gpu` in MiB: memory.used by default, or memory.total; 0 where
// there is no such GPU or no nvidia-smi.
double gpu_memory_mib(int gpu, const std::string& what = "memory.used");
// The GPU index of a device name: cuda:N -> N, cuda -> 0, anything else -> -1.
int gpu_index(const std::string& device);
std::string read_file(const std::filesystem::path& path);

// The endpoints of the first `count` "ready ENDPOINT" lines that `pid` (an executor, or the launcher
// of a sharded one) writes to `out_file`, in order, waiting up to `timeout_ms`: fewer where `pid`
// ended or the time ran out first.
std::vector<std::string> wait_ready(pid_t pid, const std::filesystem::path& out_file, int count, int timeout_ms);

struct ExecutorProcess {
  pid_t pid = 0;
  std::string endpoint;
};
// Starts build/base_executor/symbiosis-executor with `args` (after the program name), logs in
// `dir`; waits up to `timeout_s` for its ready line. Throws with its stderr when it does not come.
ExecutorProcess start_executor(const std::vector<std::string>& args, const std::filesystem::path& dir,
                               int timeout_s = 120);
// SIGTERM, then wait.
void stop(pid_t pid);

}  // namespace symbiosis::bench
