#include "base_executor/launch.h"

#include <c10/util/Exception.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <set>
#include <sstream>
#include <vector>

namespace symbiosis {
namespace {

// `listen` for part `rank`: a tcp port raised by the rank ("*" stays), an ipc path with "-RANK".
std::string part_endpoint(const std::string& listen, int rank) {
  if (listen.rfind("tcp://", 0) == 0) {
    const auto colon = listen.rfind(':');
    const std::string port = listen.substr(colon + 1);
    if (port == "*") return listen;
    return listen.substr(0, colon + 1) + std::to_string(std::stoi(port) + rank);
  }
  return listen + "-" + std::to_string(rank);
}

// The lines a part prints up to its "ready ENDPOINT" line, that one included; empty when the part
// ended before it was ready.
std::vector<std::string> lines_until_ready(int fd) {
  std::vector<std::string> lines;
  std::string line;
  char c = 0;
  while (::read(fd, &c, 1) == 1) {
    if (c != '\n') {
      line += c;
      continue;
    }
    lines.push_back(line);
    if (line.rfind("ready ", 0) == 0) return lines;
    line.clear();
  }
  return {};
}

std::vector<std::string> parse_gpus(const std::string& gpus) {
  std::vector<std::string> list;
  std::stringstream all(gpus);
  for (std::string gpu; std::getline(all, gpu, ',');) {
    if (!gpu.empty()) list.push_back(gpu);
  }
  return list;
}

}  // namespace

int launch_parts(int argc, char** argv, const ExecutorOptions& options, int parts, const std::string& gpus) {
  const auto gpu_list = parse_gpus(gpus);
  if (!gpu_list.empty()) parts = static_cast<int>(gpu_list.size());
  if (parts < 1) {
    spdlog::error("executor option --parts must be >= 1, got {}", parts);
    return 1;
  }
  // The arguments every part shares: ours, less those that differ by part.
  const std::set<std::string> per_part = {"--parts", "--gpus",       "--listen",    "--device",
                                          "--rank",  "--world-size", "--rendezvous"};
  std::vector<std::string> shared;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string flag = arg.substr(0, arg.find('='));
    if (per_part.count(flag)) {
      if (arg.find('=') == std::string::npos) ++i;  // its value follows
      continue;
    }
    shared.push_back(arg);
  }
  const std::string rendezvous =
      options.parts.rendezvous.empty() ? free_loopback_rendezvous() : options.parts.rendezvous;
  std::vector<pid_t> children;
  std::vector<int> outputs;  // each part's stdout, read until it is ready
  for (int rank = 0; rank < parts; ++rank) {
    std::vector<std::string> args = {"/proc/self/exe"};
    args.insert(args.end(), shared.begin(), shared.end());
    args.insert(args.end(), {"--rank", std::to_string(rank), "--world-size", std::to_string(parts), "--rendezvous",
                             rendezvous, "--listen", part_endpoint(options.listen, rank), "--device",
                             gpu_list.empty() ? options.device : "cuda:" + gpu_list[rank]});
    std::vector<char*> pointers;
    for (auto& a : args) pointers.push_back(a.data());
    pointers.push_back(nullptr);
    int output[2];
    if (::pipe(output) != 0) {
      const int error = errno;
      for (const pid_t child : children) ::kill(child, SIGTERM);  // the parts started so far
      TORCH_CHECK(false, "cannot make a pipe for executor part ", rank, " of ", parts,
                  "'s output: ", std::strerror(error));
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(output[1], STDOUT_FILENO);
      ::close(output[0]);
      ::close(output[1]);
      ::execv(pointers[0], pointers.data());
      _exit(127);
    }
    ::close(output[1]);
    children.push_back(pid);
    outputs.push_back(output[0]);
  }
  spdlog::info("started {} executor parts (rendezvous {})", parts, rendezvous);
  // Their "ready ENDPOINT" lines, in rank order, once all are ready. (Their pipes stay open: a part
  // writes nothing to its stdout after that line.)
  std::vector<std::string> lines;
  for (int rank = 0; rank < parts; ++rank) {
    auto part_lines = lines_until_ready(outputs[rank]);
    if (part_lines.empty()) {
      spdlog::error("executor part {} of {} ended before it was ready; stopping the others", rank, parts);
      for (const pid_t child : children) ::kill(child, SIGTERM);
      break;
    }
    lines.insert(lines.end(), part_lines.begin(), part_lines.end());
  }
  if (static_cast<int>(std::count_if(lines.begin(), lines.end(),
                                     [](const std::string& l) { return l.rfind("ready ", 0) == 0; })) == parts) {
    for (const auto& line : lines) std::cout << line << "\n";
    std::cout << std::flush;
  }
  // Stop signals go to every part; the launcher stays until all have ended.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  int failed = 0;
  bool stopping = false;
  size_t running = children.size();
  while (running > 0) {
    int status = 0;
    const pid_t ended = ::waitpid(-1, &status, WNOHANG);
    if (ended > 0) {
      running--;
      // Once stopped, a part that heard another stop first ends as one whose parts were lost (3).
      const bool lost_while_stopping = stopping && WIFEXITED(status) && WEXITSTATUS(status) == 3;
      if ((!WIFEXITED(status) || WEXITSTATUS(status) != 0) && !lost_while_stopping) failed++;
      continue;
    }
    const timespec tick{0, 200'000'000};
    const int signal = sigtimedwait(&signals, nullptr, &tick);
    if (signal == SIGINT || signal == SIGTERM) {
      stopping = true;
      for (const pid_t child : children) ::kill(child, SIGTERM);
    }
  }
  for (const int fd : outputs) ::close(fd);
  return failed == 0 ? 0 : 1;
}

}  // namespace symbiosis
