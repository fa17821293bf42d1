#pragma once
// The test side of [Hostile GPU tenants] (tests/transport/hostile_gpu_tenant.cpp), shared by
// cuda_ipc_test.cpp and nccl_test.cpp: the tenant process of one attack, told when to attack; and
// the lines the executor logs while a test runs (it runs in the test process and logs through
// spdlog's default logger), to find what it said of the attacker.
#include <gtest/gtest.h>
#include <signal.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace symbiosis::testing {

inline std::string hostile_tenant_binary() { return binary("tests/transport/hostile_gpu_tenant"); }

// The tenant process of one attack, started at once with a directory for its signal files; killed
// (SIGKILL) when it is still running at the end.
class HostileTenant {
 public:
  HostileTenant(const std::string& endpoint, const std::string& attack, const std::vector<std::string>& extra = {})
      : signals_(temp_dir("hostile-" + attack)) {
    std::vector<std::string> args = {hostile_tenant_binary(), "--executor", endpoint, "--attack", attack, "--signals",
                                     signals_.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = spawn(args);
  }
  ~HostileTenant() {
    if (pid_ > 0) end(SIGKILL);
  }
  HostileTenant(const HostileTenant&) = delete;
  HostileTenant& operator=(const HostileTenant&) = delete;

  // Set up and waiting for the word to attack (at most `limit`); false when it exited first.
  bool ready(std::chrono::milliseconds limit = std::chrono::seconds(60)) { return said("ready", limit); }
  void attack() const { std::ofstream(signals_ / "go") << "go\n"; }
  // It says it has made its attack (at most `limit`); false when it exited without saying so.
  bool attacked(std::chrono::milliseconds limit = std::chrono::seconds(60)) { return said("attacked", limit); }
  // It gave signal `name` (at most `limit`): ready, attacked, or an attack's own (stall-ahead's
  // "voided"); false when it exited without giving it.
  bool said(const char* name, std::chrono::milliseconds limit = std::chrono::seconds(60)) {
    const auto file = signals_ / name;
    wait_until([&] { return std::filesystem::exists(file) || !alive(); }, limit);
    return std::filesystem::exists(file);
  }
  bool alive() {
    reap(WNOHANG);
    return pid_ > 0;
  }
  // Waits for it to exit: its exit status, or -1 when a signal ended it.
  int wait() {
    reap(0);
    return status_;
  }
  // Sends `signal` and waits for it to end.
  void end(int signal) {
    if (pid_ > 0) ::kill(pid_, signal);
    reap(0);
  }

 private:
  void reap(int options) {
    if (pid_ <= 0) return;
    int status = 0;
    if (::waitpid(pid_, &status, options) != pid_) return;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    pid_ = 0;
  }

  std::filesystem::path signals_;
  pid_t pid_ = 0;
  int status_ = -1;
};

// The lines spdlog's default logger writes from construction to destruction. Attach it before the
// executor starts and let it go after the executor has stopped: the logger's sinks are not guarded
// against threads that log meanwhile.
class ExecutorLog {
 public:
  ExecutorLog() { spdlog::default_logger()->sinks().push_back(sink_); }
  ~ExecutorLog() {
    if (kept_attached_) return;
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  // Leaves the sink in the logger past this object (it owns a share of it): for an executor left
  // running (end_executor).
  void keep_attached() { kept_attached_ = true; }
  ExecutorLog(const ExecutorLog&) = delete;
  ExecutorLog& operator=(const ExecutorLog&) = delete;

  // The executor's id of the client of tenant `tenant`, from its "connected" line; 0 if none.
  uint64_t client_id(const std::string& tenant) const {
    for (const auto& line : sink_->lines()) {
      if (line.rfind("client ", 0) == 0 && line.find("(tenant '" + tenant + "'") != std::string::npos &&
          line.find(") connected") != std::string::npos) {
        return std::stoull(line.substr(7));
      }
    }
    return 0;
  }
  // What the executor said when it let client `id` go (dropped it, or found it gone), " | "
  // between lines; empty if it said nothing.
  std::string drop_reason(uint64_t id) const {
    std::string reason;
    for (const auto& line : lines_of(id)) {
      for (const char* word : {"dropping", "is gone", "closed its local link", "disconnected", " left"}) {
        if (line.find(word) == std::string::npos) continue;
        reason += (reason.empty() ? "" : " | ") + line;
        break;
      }
    }
    return reason;
  }
  // Whether a line the executor logged of client `id` says `text`.
  bool logged(uint64_t id, const std::string& text) const {
    const auto lines = lines_of(id);
    return std::any_of(lines.begin(), lines.end(),
                       [&](const auto& line) { return line.find(text) != std::string::npos; });
  }

 private:
  // The lines that begin "client ID " or "client ID:".
  std::vector<std::string> lines_of(uint64_t id) const {
    const std::string named = "client " + std::to_string(id);
    std::vector<std::string> found;
    for (const auto& line : sink_->lines()) {
      if (line.rfind(named + " ", 0) == 0 || line.rfind(named + ":", 0) == 0) found.push_back(line);
    }
    return found;
  }

  class Sink : public spdlog::sinks::base_sink<std::mutex> {
   public:
    std::vector<std::string> lines() {
      std::lock_guard<std::mutex> lock(mutex_);
      return lines_;
    }

   protected:
    void sink_it_(const spdlog::details::log_msg& message) override {
      lines_.emplace_back(message.payload.data(), message.payload.size());
    }
    void flush_() override {}

   private:
    std::vector<std::string> lines_;  // guarded by base_sink's mutex_
  };
  std::shared_ptr<Sink> sink_ = std::make_shared<Sink>();
  bool kept_attached_ = false;
};

// Ends a test's in-process executor, before its log goes: destroyed when the test passed; left
// running, its log still attached, when the test failed. An executor wedged in a CUDA call (one
// that waits for a transfer no one will end) cannot be destroyed: the test binary would hang in
// the test's tear-down instead of reporting its failures.
template <typename Executor>
void end_executor(std::unique_ptr<Executor>& executor, ExecutorLog& log, bool failed) {
  if (!failed) {
    executor.reset();
    return;
  }
  (void)executor.release();
  log.keep_attached();
}

}  // namespace symbiosis::testing
