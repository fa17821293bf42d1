// symbiosis-soak: a bounded soak with churn. One executor process serves up to --clients tenant
// processes (bench/soak_client.cpp) of the --transports given for --seconds, while they join,
// leave (Goodbye), are killed (SIGKILL) and come back; every client checks each of its steps
// against monolithic execution of the same weights ([Soak exactness] in soak_client.cpp). It
// fails (exit status 1, naming each violation) when a client differed, failed or stalled, when a
// call took longer than --max-call-ms, when the executor died, or when the executor did not end
// where it started ([Soak baseline]). It prints a summary either way.
//   symbiosis-soak --seconds 600 --clients 64 --transports tcp,shm
//   symbiosis-soak --seconds 600 --clients 64 --transports cuda-ipc,shm,tcp --device cuda:0
//
// [Soak slots] Client i holds slot i, whose tenant ("soak-i") comes back whenever its process
// ends, over the slot's transport (the transports in turn). A quarter of the slots are steady:
// their client runs from the start to the end, exact over the whole soak. The client of any other
// slot either leaves after a number of steps drawn from 1 to --leave-within-steps, or is killed at
// a time drawn from 0 to --kill-within-s after its start (starting up, in a call, anywhere), and
// the slot's tenant comes back within a second.
//
// [Soak baseline] First every slot's client runs --warmup-steps steps at once and leaves, so that
// the executor has met the soak's load; with no client left, its resident memory, open
// descriptors, mapped shared segments (memfd mappings: clients' segments are anonymous) and the
// GPU's memory in use are the baseline. After the churn, every client is told to leave, and the
// same figures must be back: memory within --rss-tolerance-mib (--gpu-tolerance-mib), no more
// mapped segments than at the baseline, no new entry of ours in /dev/shm, and no client the
// executor still counts but killed TCP clients: it holds those for its idle limit of ten minutes,
// since only silence tells it they are gone (base_executor/client_registry.h), each with its local
// link open, so the descriptors may exceed the baseline's by one for each of them.
#include <CLI/CLI.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "bench/process.h"
#include "transport/client_transport.h"

namespace fs = std::filesystem;
using namespace symbiosis::bench;

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMiB = 1024.0 * 1024.0;

// What one soak does; the flags of main() map onto these one to one.
struct SoakOptions {
  double seconds = 600;                                  // the churn's length
  int clients = 64;                                      // client processes at once, at most ([Soak slots])
  std::vector<std::string> transports = {"tcp", "shm"};  // the slots' transports in turn
  std::string device = "cpu";                            // the executor's; cuda-ipc clients run there too
  std::string preset = "tiny-llama";                     // checkpoint made by symbiosis-make-checkpoint ...
  std::string model;                                     // ... unless this names one
  std::string out = "/tmp/symbiosis-soak";               // checkpoint, logs, executor memory samples
  std::string batching = "opportunistic";                // the executor's policy
  int executor_threads = 0;                              // the executor's GEMM threads (0: its default)
  double max_call_ms = 10000;                            // no call may take longer ([Call time] in soak_client.cpp)
  double tolerance = 1e-5;                               // [Soak exactness]: logits and loss
  double gradient_tolerance = 1e-5;                      // ... and adapter gradients
  double rss_tolerance_mib = 64;                         // [Soak baseline]
  double gpu_tolerance_mib = 64;
  int warmup_steps = 3;
  double kill_within_s = 20;
  int leave_within_steps = 10;
  double stall_s = 180;         // a client with no step for this long (from its start) has stalled
  double stop_timeout_s = 180;  // clients told to leave must be gone by then
  uint64_t seed = 1;

  void validate() const {
    auto check = [](bool ok, const std::string& what) {
      if (!ok) throw std::invalid_argument(what);
    };
    check(seconds > 0, "--seconds must be > 0, got " + std::to_string(seconds));
    check(clients >= 1 && clients <= 1024, "--clients must be in [1, 1024], got " + std::to_string(clients));
    check(!transports.empty(), "--transports names none (expected some of tcp, shm, cuda-ipc)");
    for (const auto& t : transports) {
      check(t == "tcp" || t == "shm" || t == "cuda-ipc", "--transports: '" + t + "' is not one of tcp, shm, cuda-ipc");
      check(t != "cuda-ipc" || gpu_index(device) >= 0, "--transports: cuda-ipc needs --device cuda:N, got " + device);
    }
    check(max_call_ms > 0, "--max-call-ms must be > 0, got " + std::to_string(max_call_ms));
    check(warmup_steps >= 1, "--warmup-steps must be >= 1, got " + std::to_string(warmup_steps));
    check(kill_within_s > 0, "--kill-within-s must be > 0, got " + std::to_string(kill_within_s));
    check(leave_within_steps >= 1, "--leave-within-steps must be >= 1, got " + std::to_string(leave_within_steps));
  }
};

// `value` with one decimal, for messages; or every digit it has, for a command line.
std::string decimal(double value, const char* format = "%.1f") {
  char text[32];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// What the executor holds that a departed client could leave behind ([Soak baseline]).
struct ExecutorFootprint {
  size_t resident = 0;
  size_t descriptors = 0;
  size_t mapped_segments = 0;  // memfd mappings
  double gpu_mib = 0;          // the whole GPU's memory in use (no client is on it then)

  static ExecutorFootprint of(pid_t pid, int gpu) {
    ExecutorFootprint f;
    f.resident = resident_bytes(pid);
    std::error_code ec;
    for (auto it = fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec); !ec && it != fs::end(it);
         it.increment(ec)) {
      f.descriptors++;
    }
    std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
    for (std::string line; std::getline(maps, line);) {
      if (line.find("/memfd:") != std::string::npos) f.mapped_segments++;
    }
    f.gpu_mib = gpu_memory_mib(gpu);
    return f;
  }
};

std::set<std::string> shm_entries() {
  std::set<std::string> names;
  std::error_code ec;
  for (auto it = fs::directory_iterator("/dev/shm", ec); !ec && it != fs::end(it); it.increment(ec)) {
    names.insert(it->path().filename().string());
  }
  return names;
}

// The last whole line of a client's progress that parses (a killed client may have written half of one).
nlohmann::json last_progress(const fs::path& file) {
  std::istringstream text(read_file(file));
  nlohmann::json last;
  for (std::string line; std::getline(text, line);) {
    auto parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_object()) last = std::move(parsed);
  }
  return last;
}

std::string tail(const std::string& text, size_t bytes = 600) {
  return text.size() <= bytes ? text : "..." + text.substr(text.size() - bytes);
}

// One slot's tenant ([Soak slots]) and its current process.
struct Slot {
  enum class Fate { kStays, kLeaves, kKilled };
  int index = 0;
  std::string transport, device;
  bool steady = false;
  int generation = 0;    // processes started so far
  bool churned = false;  // a process of the churn has started: the next one comes back
  pid_t pid = 0;         // 0: none running
  Fate fate = Fate::kStays;
  bool kill_sent = false;
  Clock::time_point started, kill_at, come_back_at, last_step;
  int64_t steps = 0;  // of the running process
  fs::path out, err;

  std::string name() const { return "soak-" + std::to_string(index); }
  std::string process_name() const {
    return name() + " (" + transport + ", process " + std::to_string(generation) + ")";
  }
};

struct Tally {
  int started = 0, came_back = 0, killed = 0, left = 0, stayed = 0;
  int64_t steady_min_steps = -1;  // the fewest steps a steady client of the churn made ([Soak slots])
  uint64_t calls = 0, steps = 0;
  double max_call_ms = 0, worst_output_error = 0, worst_gradient_error = 0;
  std::string slowest;  // the client that made the longest call
};

class Soak {
 public:
  explicit Soak(SoakOptions options)
      : options_(std::move(options)), random_(options_.seed), gpu_(gpu_index(options_.device)) {}

  int run() {
    const fs::path out = options_.out;
    fs::create_directories(out / "clients");
    model_ = options_.model.empty() ? make_model(out) : fs::path(options_.model);
    shm_before_ = shm_entries();
    std::vector<std::string> args = {"--model",     model_.string(), "--listen",   "tcp://127.0.0.1:*",
                                     "--device",    options_.device, "--batching", options_.batching,
                                     "--log-level", "warn"};
    if (options_.executor_threads > 0)
      args.insert(args.end(), {"--threads", std::to_string(options_.executor_threads)});
    executor_ = start_executor(args, out);
    std::printf("soak: executor %s (pid %d, %s), %d clients at most over %s, %.0f s; logs in %s\n",
                executor_.endpoint.c_str(), executor_.pid, options_.device.c_str(), options_.clients,
                join(options_.transports).c_str(), options_.seconds, out.c_str());
    std::fflush(stdout);
    for (int i = 0; i < options_.clients; ++i) {
      Slot slot;
      slot.index = i;
      slot.transport = options_.transports[i % options_.transports.size()];
      slot.device = slot.transport == "cuda-ipc" ? options_.device : "cpu";
      slot.steady = (i / options_.transports.size()) % 4 == 0;
      slots_.push_back(slot);
    }
    samples_.open(out / "executor_memory.csv");
    samples_ << "seconds,phase,resident_mib,gpu_used_mib,clients\n";
    started_ = Clock::now();

    try {
      warm_up();
      const auto baseline = settled_footprint("baseline");
      if (violations_.empty()) churn();
      const auto end = settled_footprint("end");
      check_end(baseline, end);
      if (executor_.pid != 0) stop(std::exchange(executor_.pid, 0));
      report(baseline, end);
    } catch (...) {
      abandon();
      throw;
    }
    return violations_.empty() ? 0 : 1;
  }

 private:
  static std::string join(const std::vector<std::string>& parts) {
    std::string s;
    for (const auto& p : parts) s += (s.empty() ? "" : ",") + p;
    return s;
  }

  fs::path make_model(const fs::path& out) {
    const fs::path dir = out / "model";
    const std::string command = (build_dir() / "tools/symbiosis-make-checkpoint").string() + " --preset " +
                                options_.preset + " --out " + dir.string() + " > " +
                                (out / "make_checkpoint.log").string();
    if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
    return dir;
  }

  // After an error of the soak itself: no process of it outlives it.
  void abandon() {
    for (auto& slot : slots_) {
      if (slot.pid == 0) continue;
      kill(slot.pid, SIGKILL);
      waitpid(slot.pid, nullptr, 0);
    }
    if (executor_.pid != 0) {
      kill(executor_.pid, SIGKILL);
      waitpid(executor_.pid, nullptr, 0);
    }
  }

  void violation(const std::string& what) {
    std::fprintf(stderr, "soak: VIOLATION: %s\n", what.c_str());
    violations_.push_back(what);
  }

  void spawn_client(Slot& slot, const fs::path& stop_file, bool churning) {
    slot.fate = !churning || slot.steady ? Slot::Fate::kStays
                : random_() % 2 == 0     ? Slot::Fate::kLeaves
                                         : Slot::Fate::kKilled;
    const int64_t steps =
        slot.fate == Slot::Fate::kLeaves ? 1 + static_cast<int64_t>(random_() % options_.leave_within_steps) : -1;
    const std::string tag = slot.name() + "-" + std::to_string(slot.generation);
    slot.out = fs::path(options_.out) / "clients" / (tag + ".out");
    slot.err = fs::path(options_.out) / "clients" / (tag + ".err");
    const std::vector<std::string> args = {
        (build_dir() / "bench/symbiosis-soak-client").string(),
        "--executor",
        executor_.endpoint,
        "--model",
        model_.string(),
        "--tenant",
        slot.name(),
        "--transport",
        slot.transport,
        "--device",
        slot.device,
        "--seed",
        std::to_string(options_.seed * 1000003 + slot.index * 1009 + slot.generation),
        "--steps",
        std::to_string(steps),
        "--stop-file",
        stop_file.string(),
        "--tolerance",
        decimal(options_.tolerance, "%.17g"),
        "--gradient-tolerance",
        decimal(options_.gradient_tolerance, "%.17g")};
    slot.pid = spawn(args, slot.out, slot.err);
    slot.started = slot.last_step = Clock::now();
    slot.kill_at = slot.started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                      std::uniform_real_distribution<double>(0, options_.kill_within_s)(random_)));
    slot.kill_sent = false;
    slot.steps = 0;
    tally_.started++;
    if (churning && slot.churned) tally_.came_back++;
    slot.churned = slot.churned || churning;
    slot.generation++;
  }

  // Reads the slot's progress; when its process has ended, reaps it and counts how it ended.
  // Returns true when it has ended.
  bool poll(Slot& slot) {
    const auto progress = last_progress(slot.out);
    const int64_t steps = progress.is_object() ? progress.value("steps", int64_t{0}) : 0;
    if (steps != slot.steps) {
      slot.steps = steps;
      slot.last_step = Clock::now();
    }
    int status = 0;
    if (waitpid(slot.pid, &status, WNOHANG) != slot.pid) {
      if (seconds_since(slot.last_step) > options_.stall_s) {
        violation(slot.process_name() + " made no step for " + std::to_string(int(options_.stall_s)) + " s (" +
                  std::to_string(steps) + " steps so far)");
        kill(slot.pid, SIGKILL);
        waitpid(slot.pid, nullptr, 0);
        slot.pid = 0;
        return true;
      }
      return false;
    }
    slot.pid = 0;
    if (progress.is_object()) {
      tally_.steps += steps;
      tally_.calls += progress.value("calls", uint64_t{0});
      tally_.worst_output_error = std::max(tally_.worst_output_error, progress.value("worst_output_error", 0.0));
      tally_.worst_gradient_error = std::max(tally_.worst_gradient_error, progress.value("worst_gradient_error", 0.0));
      const double call_ms = progress.value("max_call_ms", 0.0);
      if (call_ms > tally_.max_call_ms) {
        tally_.max_call_ms = call_ms;
        tally_.slowest = slot.process_name();
      }
      if (call_ms > options_.max_call_ms) {
        violation(slot.process_name() + " made a call of " + decimal(call_ms) + " ms, over --max-call-ms " +
                  decimal(options_.max_call_ms));
      }
    }
    bool expected = false;
    if (slot.kill_sent && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
      tally_.killed++;
      expected = true;
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      (slot.fate == Slot::Fate::kLeaves ? tally_.left : tally_.stayed)++;
      if (slot.steady && slot.churned) {
        tally_.steady_min_steps = tally_.steady_min_steps < 0 ? steps : std::min(tally_.steady_min_steps, steps);
      }
      expected = true;
    } else {
      const std::string how = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                                : "died of signal " + std::to_string(WTERMSIG(status));
      violation(slot.process_name() + " " + how + " after " + std::to_string(steps) +
                " steps: " + tail(read_file(slot.err)));
    }
    if (expected) {  // only a failure's logs are kept
      std::error_code ec;
      fs::remove(slot.out, ec);
      fs::remove(slot.err, ec);
    }
    return true;
  }

  void sample(const char* phase) {
    const size_t rss = resident_bytes(executor_.pid);
    peak_resident_ = std::max(peak_resident_, rss);
    if (seconds_since(last_sample_) < 10) return;
    last_sample_ = Clock::now();
    int running = 0;
    for (const auto& s : slots_) running += s.pid != 0;
    samples_ << static_cast<int>(seconds_since(started_)) << "," << phase << "," << rss / kMiB << ","
             << gpu_memory_mib(gpu_) << "," << running << std::endl;
  }

  bool executor_alive() {
    int status = 0;
    if (waitpid(executor_.pid, &status, WNOHANG) != executor_.pid) return true;
    violation("the executor exited (status " + std::to_string(status) +
              "): " + tail(read_file(fs::path(options_.out) / "executor.err")));
    executor_.pid = 0;
    return false;
  }

  // Tells every running client to leave through `stop_file` and waits for them (killing those
  // still there after --stop-timeout-s).
  void stop_all(const fs::path& stop_file, const char* phase) {
    std::ofstream(stop_file) << "stop\n";
    const auto deadline = Clock::now() + std::chrono::duration<double>(options_.stop_timeout_s);
    for (bool running = true; running;) {
      running = false;
      for (auto& slot : slots_) {
        if (slot.pid != 0 && !poll(slot)) running = true;
      }
      sample(phase);
      if (running && Clock::now() > deadline) {
        for (auto& slot : slots_) {
          if (slot.pid == 0) continue;
          violation(slot.process_name() + " did not leave within " + std::to_string(int(options_.stop_timeout_s)) +
                    " s of being told to");
          kill(slot.pid, SIGKILL);
          waitpid(slot.pid, nullptr, 0);
          slot.pid = 0;
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // [Soak baseline]: every slot's client at once, until each has made --warmup-steps steps.
  void warm_up() {
    const fs::path stop_file = fs::path(options_.out) / "warmup.stop";
    fs::remove(stop_file);
    for (auto& slot : slots_) spawn_client(slot, stop_file, /*churning=*/false);
    for (bool warm = false; !warm && violations_.empty() && executor_alive();) {
      warm = true;
      for (auto& slot : slots_) {
        if (slot.pid != 0) poll(slot);
        if (slot.pid == 0 && violations_.empty()) violation(slot.process_name() + " ended during the warm-up");
        warm = warm && slot.steps >= options_.warmup_steps;
      }
      sample("warmup");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    stop_all(stop_file, "warmup");
    warmup_clients_ = tally_.started;
    // The churn's clients are counted from here; calls, steps and the longest call include the warm-up's.
    tally_.started = tally_.stayed = 0;
    std::printf("soak: warm after %.0f s\n", seconds_since(started_));
    std::fflush(stdout);
  }

  void churn() {
    const fs::path stop_file = fs::path(options_.out) / "soak.stop";
    fs::remove(stop_file);
    const auto churn_start = Clock::now();
    const auto end =
        churn_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.seconds));
    for (auto& slot : slots_) spawn_client(slot, stop_file, /*churning=*/true);
    auto last_report = Clock::now();
    while (Clock::now() < end && violations_.empty() && executor_alive()) {
      for (auto& slot : slots_) {
        if (slot.pid == 0) {
          if (Clock::now() >= slot.come_back_at) spawn_client(slot, stop_file, /*churning=*/true);
          continue;
        }
        if (slot.fate == Slot::Fate::kKilled && !slot.kill_sent && Clock::now() >= slot.kill_at) {
          kill(slot.pid, SIGKILL);
          slot.kill_sent = true;
          if (slot.transport == "tcp") killed_tcp_++;
        }
        if (poll(slot)) {
          slot.come_back_at = Clock::now() + std::chrono::milliseconds(random_() % 1000);
        }
      }
      sample("churn");
      if (seconds_since(last_report) >= 60) {
        last_report = Clock::now();
        std::printf("soak: %.0f s: %d clients started, %d killed, %d left; executor %.1f MiB\n",
                    seconds_since(churn_start), tally_.started, tally_.killed, tally_.left,
                    resident_bytes(executor_.pid) / kMiB);
        std::fflush(stdout);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    churn_seconds_ = seconds_since(churn_start);
    stop_all(stop_file, "stop");
    if (violations_.empty() && (tally_.killed == 0 || tally_.left == 0 || tally_.came_back == 0)) {
      violation("the soak did not churn: " + std::to_string(tally_.killed) + " clients killed, " +
                std::to_string(tally_.left) + " left, " + std::to_string(tally_.came_back) +
                " came back (lengthen --seconds)");
    }
  }

  // The executor's footprint once it has let every client go: it must count no client but killed
  // TCP ones ([Soak baseline]) within 10 s.
  ExecutorFootprint settled_footprint(const char* phase) {
    if (executor_.pid == 0) return {};
    uint64_t counted = 0;
    try {
      for (int i = 0; i < 100; ++i) {
        counted = symbiosis::request_stats(executor_.endpoint, 10000).clients();
        if (counted <= killed_tcp_) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const std::exception& e) {
      violation(std::string("at the ") + phase + " the executor did not answer for its statistics: " + e.what());
    }
    if (counted > killed_tcp_) {
      violation("at the " + std::string(phase) + " the executor still counts " + std::to_string(counted) +
                " clients 10 s after all left; only the " + std::to_string(killed_tcp_) +
                " killed TCP clients may linger (its idle limit)");
    }
    lingering_clients_ = counted;
    std::this_thread::sleep_for(std::chrono::seconds(1));
    return ExecutorFootprint::of(executor_.pid, gpu_);
  }

  void check_end(const ExecutorFootprint& baseline, const ExecutorFootprint& end) {
    if (executor_.pid == 0) return;
    const double grew_mib = (static_cast<double>(end.resident) - static_cast<double>(baseline.resident)) / kMiB;
    if (grew_mib > options_.rss_tolerance_mib) {
      violation("the executor's resident memory grew by " + decimal(grew_mib) + " MiB over the soak (" +
                decimal(baseline.resident / kMiB) + " -> " + decimal(end.resident / kMiB) +
                " MiB), over --rss-tolerance-mib " + decimal(options_.rss_tolerance_mib));
    }
    if (gpu_ >= 0 && end.gpu_mib - baseline.gpu_mib > options_.gpu_tolerance_mib) {
      violation("GPU " + std::to_string(gpu_) + "'s memory in use grew by " + decimal(end.gpu_mib - baseline.gpu_mib) +
                " MiB over the soak (" + decimal(baseline.gpu_mib) + " -> " + decimal(end.gpu_mib) +
                " MiB), over --gpu-tolerance-mib " + decimal(options_.gpu_tolerance_mib));
    }
    if (end.mapped_segments > baseline.mapped_segments) {
      violation("the executor still maps " + std::to_string(end.mapped_segments - baseline.mapped_segments) +
                " shared segments of departed clients (" + std::to_string(baseline.mapped_segments) +
                " at the baseline)");
    }
    // A killed TCP client the executor still counts keeps its record's local link open
    // (ClientRecord::link in base_executor/client_registry.h): one descriptor each.
    if (end.descriptors > baseline.descriptors + lingering_clients_) {
      violation("the executor holds " + std::to_string(end.descriptors - baseline.descriptors) +
                " more open descriptors than at the baseline (" + std::to_string(baseline.descriptors) +
                "), more than the " + std::to_string(lingering_clients_) +
                " of the killed TCP clients it still counts");
    }
    // Clients' segments are anonymous (transport/shared_memory.h); a named one left in /dev/shm by
    // a soak process, or with the project's prefix, is a leak. (Others' entries may come and go.)
    for (const auto& name : shm_entries()) {
      if (shm_before_.count(name) != 0) continue;
      const bool ours = name.rfind("symbiosis", 0) == 0 && name.rfind("symbiosis-fuzz-", 0) != 0;
      if (ours || name.find(std::to_string(executor_.pid)) != std::string::npos) {
        violation("/dev/shm/" + name + " was left behind");
      }
    }
  }

  void report(const ExecutorFootprint& baseline, const ExecutorFootprint& end) {
    std::printf("soak: %.0f s of churn, %d clients at most over %s (executor on %s, %s batching)\n", churn_seconds_,
                options_.clients, join(options_.transports).c_str(), options_.device.c_str(),
                options_.batching.c_str());
    std::printf(
        "clients: %d started after %d in the warm-up (%d of them came back after one of the churn ended), "
        "%d killed, %d left, %d stayed to the end\n",
        tally_.started, warmup_clients_, tally_.came_back, tally_.killed, tally_.left, tally_.stayed);
    int steady = 0;
    for (const auto& slot : slots_) steady += slot.steady;
    std::printf("steady clients: %d ran the whole churn, exact at every step, each of at least %lld steps\n", steady,
                static_cast<long long>(tally_.steady_min_steps));
    std::printf("calls: %llu in %llu checked steps; longest call %.1f ms (%s; bound %.0f ms)\n",
                static_cast<unsigned long long>(tally_.calls), static_cast<unsigned long long>(tally_.steps),
                tally_.max_call_ms, tally_.slowest.c_str(), options_.max_call_ms);
    std::printf(
        "largest relative difference from monolithic: logits and loss %.3g (tolerance %.3g), adapter "
        "gradients %.3g (tolerance %.3g)\n",
        tally_.worst_output_error, options_.tolerance, tally_.worst_gradient_error, options_.gradient_tolerance);
    std::printf(
        "executor RSS: %.1f MiB after the warm-up, peak %.1f MiB, end %.1f MiB (%+.1f MiB; tolerance %.0f MiB)\n",
        baseline.resident / kMiB, peak_resident_ / kMiB, end.resident / kMiB,
        (static_cast<double>(end.resident) - static_cast<double>(baseline.resident)) / kMiB,
        options_.rss_tolerance_mib);
    std::printf(
        "executor descriptors %zu -> %zu, mapped segments %zu -> %zu, clients counted at the end %llu "
        "(killed TCP clients held for the idle limit: at most %llu)\n",
        baseline.descriptors, end.descriptors, baseline.mapped_segments, end.mapped_segments,
        static_cast<unsigned long long>(lingering_clients_), static_cast<unsigned long long>(killed_tcp_));
    if (gpu_ >= 0) {
      std::printf("GPU %d memory in use: %.0f MiB after the warm-up, end %.0f MiB (%+.0f MiB; tolerance %.0f MiB)\n",
                  gpu_, baseline.gpu_mib, end.gpu_mib, end.gpu_mib - baseline.gpu_mib, options_.gpu_tolerance_mib);
    }
    if (violations_.empty()) {
      std::printf("soak PASSED\n");
    } else {
      std::printf("soak FAILED: %zu violations:\n", violations_.size());
      for (const auto& v : violations_) std::printf("  %s\n", v.c_str());
    }
    std::fflush(stdout);
  }

  SoakOptions options_;
  std::mt19937_64 random_;
  int gpu_;
  fs::path model_;
  ExecutorProcess executor_;
  std::vector<Slot> slots_;
  std::set<std::string> shm_before_;
  std::vector<std::string> violations_;
  Tally tally_;
  int warmup_clients_ = 0;
  uint64_t killed_tcp_ = 0;
  uint64_t lingering_clients_ = 0;
  double churn_seconds_ = 0;
  size_t peak_resident_ = 0;
  Clock::time_point started_, last_sample_;
  std::ofstream samples_;
};

}  // namespace

int main(int argc, char** argv) {
  SoakOptions options;
  std::string transports = "tcp,shm";
  CLI::App app{"symbiosis-soak: clients join, leave, are killed and come back on one executor; each stays exact"};
  app.add_option("--seconds", options.seconds, "length of the churn")->capture_default_str();
  app.add_option("--clients", options.clients, "client processes at once, at most")->capture_default_str();
  app.add_option("--transports", transports, "the clients' transports, in turn: tcp, shm, cuda-ipc")
      ->capture_default_str();
  app.add_option("--device", options.device, "the executor's device (cuda-ipc clients run there too)")
      ->capture_default_str();
  app.add_option("--preset", options.preset, "checkpoint preset (symbiosis-make-checkpoint)")->capture_default_str();
  app.add_option("--model", options.model, "an existing checkpoint instead of --preset");
  app.add_option("--out", options.out, "directory for the checkpoint, logs and executor memory samples")
      ->capture_default_str();
  app.add_option("--batching", options.batching, "the executor's batching policy")->capture_default_str();
  app.add_option("--executor-threads", options.executor_threads, "the executor's GEMM threads (0: its default)")
      ->capture_default_str();
  app.add_option("--max-call-ms", options.max_call_ms, "fail when a call took longer")->capture_default_str();
  app.add_option("--tolerance", options.tolerance,
                 "logits and loss: largest relative difference from monolithic "
                 "execution")
      ->capture_default_str();
  app.add_option("--gradient-tolerance", options.gradient_tolerance, "adapter gradients: the same")
      ->capture_default_str();
  app.add_option("--rss-tolerance-mib", options.rss_tolerance_mib,
                 "the executor's resident memory may end this much above "
                 "where it was after the warm-up")
      ->capture_default_str();
  app.add_option("--gpu-tolerance-mib", options.gpu_tolerance_mib, "the same for the GPU's memory in use")
      ->capture_default_str();
  app.add_option("--warmup-steps", options.warmup_steps, "steps of every client at once before the baseline")
      ->capture_default_str();
  app.add_option("--kill-within-s", options.kill_within_s,
                 "a client to be killed is killed within this after its start")
      ->capture_default_str();
  app.add_option("--leave-within-steps", options.leave_within_steps, "a client to leave leaves within this many steps")
      ->capture_default_str();
  app.add_option("--stall-s", options.stall_s, "fail when a client made no step for this long")->capture_default_str();
  app.add_option("--stop-timeout-s", options.stop_timeout_s, "clients told to leave must be gone within this")
      ->capture_default_str();
  app.add_option("--seed", options.seed, "seed of the churn and the clients")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    options.transports.clear();
    std::stringstream list(transports);
    for (std::string t; std::getline(list, t, ',');) options.transports.push_back(t);
    options.validate();
    return Soak(options).run();
  } catch (const std::exception& e) {
    std::cerr << "symbiosis-soak: " << e.what() << std::endl;
    return 2;
  }
}
