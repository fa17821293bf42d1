#include "tests/python_reference.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

namespace symbiosis::testing {
namespace {

namespace fs = std::filesystem;

const fs::path kScripts = fs::path(SYMBIOSIS_SOURCE_DIR) / "tests" / "reference";

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// One server per build and Python: its socket lies in /tmp (a Unix socket's path is short).
fs::path socket_path() {
  const auto key = std::hash<std::string>{}(std::string(SYMBIOSIS_BINARY_DIR) + "|" + SYMBIOSIS_PYTHON);
  return fs::temp_directory_path() / ("symbiosis-reference-" + std::to_string(key) + ".sock");
}

int connect_to(const fs::path& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Starts the server in a session of its own, holding none of our descriptors (ctest waits for every
// holder of a test's output pipes); returns its pid.
pid_t start_server(const fs::path& path) {
  const pid_t child = ::fork();
  if (child == 0) {
    ::setsid();
    const int log = ::open((path.string() + ".log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, 0);
    ::dup2(log, 1);
    ::dup2(log, 2);
    ::close_range(3, ~0U, 0);
    const std::string server = (kScripts / "server.py").string();
    ::execlp(SYMBIOSIS_PYTHON, SYMBIOSIS_PYTHON, server.c_str(), path.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return child;
}

// A connection to the server, starting it when none answers (one starter at a time); -1 when it
// does not come up (it exited: no Python, say).
int connect_to_server() {
  const auto path = socket_path();
  if (const int fd = connect_to(path); fd >= 0) return fd;
  const int lock = ::open((path.string() + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock < 0) return -1;
  ::flock(lock, LOCK_EX);
  int fd = connect_to(path);
  if (fd < 0) {
    const pid_t server = start_server(path);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    while (fd < 0 && server > 0 && ::waitpid(server, nullptr, WNOHANG) == 0 &&
           std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      fd = connect_to(path);
    }
  }
  ::close(lock);  // and with it the lock
  return fd;
}

// The exit status the server answers for the request; nothing when it did not answer.
std::optional<int> through_server(const std::vector<std::string>& argv, const fs::path& log) {
  const int fd = connect_to_server();
  if (fd < 0) return std::nullopt;
  const std::string request = nlohmann::json{{"argv", argv}, {"log", log.string()}}.dump() + "\n";
  std::string answer;
  bool sent = ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size());
  char buffer[64];
  while (sent && answer.find('\n') == std::string::npos) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    answer.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  if (answer.find('\n') == std::string::npos) return std::nullopt;
  return std::atoi(answer.c_str());
}

}  // namespace

int run_reference(const std::string& script, const std::vector<std::string>& args, const fs::path& log) {
  std::vector<std::string> argv{(kScripts / script).string()};
  argv.insert(argv.end(), args.begin(), args.end());
  // A server that left between our connection and its answer (its idle end) is started again once.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (const auto status = through_server(argv, log)) return *status;
  }
  std::string command = quoted(SYMBIOSIS_PYTHON);
  for (const auto& a : argv) command += " " + quoted(a);
  command += " > " + quoted(log.string()) + " 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace symbiosis::testing
