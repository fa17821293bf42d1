// symbiosis-bench-wake: what it costs to wake a sleeping executor's scheduler from a same-host
// client, with the shared futex doorbell the executor had and with the wake socket each client has
// now ([Wake sockets] in transport/call_ring.h), in the same run. Two processes on this host play
// client and scheduler; neither spins, so every round trip is a wake of each side: the client
// wakes the scheduler (doorbell or socket), the scheduler answers through the reply ring's futex
// word, as the executor does. Prints the round trip's percentiles for each, as JSON.
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <new>
#include <vector>

#include "transport/call_ring.h"

namespace {

using Clock = std::chrono::steady_clock;
using symbiosis::shm::ControlBlock;

struct Shared {
  ControlBlock block;                 // executor_sleeping and the replies' wait word
  symbiosis::shm::WaitWord doorbell;  // the old way: one word every client rings
  std::atomic<uint32_t> requests{0};  // the client's calls so far
  std::atomic<bool> stop{false};
};

// The scheduler's side: sleeps until a call comes, answers it, until told to stop.
void serve(Shared& shared, bool by_socket, int reader) {
  uint32_t served = 0;
  while (!shared.stop.load()) {
    if (by_socket) {
      shared.block.executor_sleeping.store(1);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (shared.requests.load() == served) {
        pollfd fd{reader, POLLIN, 0};
        const timespec timeout{0, 100'000'000};
        if (::ppoll(&fd, 1, &timeout, nullptr) > 0) symbiosis::shm::drain(reader);
      }
      shared.block.executor_sleeping.store(0);
    } else {
      const uint32_t seen = shared.doorbell.current();
      if (shared.requests.load() == served) {
        shared.doorbell.sleep_while(seen, Clock::now() + std::chrono::milliseconds(100));
      }
    }
    while (served != shared.requests.load()) {
      ++served;
      shared.block.replies.wait().notify();
    }
  }
}

std::vector<double> round_trips(Shared& shared, bool by_socket, int writer, int count) {
  std::vector<double> micros;
  auto& replies = shared.block.replies.wait();
  for (int i = 0; i < count; ++i) {
    const uint32_t seen = replies.current();
    const auto start = Clock::now();
    shared.requests.fetch_add(1);
    if (by_socket) {
      symbiosis::shm::wake_executor(shared.block, writer);
    } else {
      shared.doorbell.notify();
    }
    symbiosis::shm::wait_until(
        replies, [&] { return replies.current() != seen; }, std::chrono::nanoseconds(0),
        Clock::now() + std::chrono::seconds(5));
    micros.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  return micros;
}

nlohmann::json measure(bool by_socket, int count) {
  auto memory = symbiosis::shm::SharedMemory::create("bench-wake", sizeof(Shared));
  auto* shared = new (memory.data()) Shared();
  symbiosis::shm::WakeSocket wake;
  const pid_t scheduler = ::fork();
  if (scheduler == 0) {
    serve(*shared, by_socket, wake.reader());
    ::_exit(0);
  }
  auto micros = round_trips(*shared, by_socket, wake.writer(), count);
  shared->stop.store(true);
  shared->doorbell.notify();
  symbiosis::shm::wake(wake.writer());
  ::waitpid(scheduler, nullptr, 0);
  std::sort(micros.begin(), micros.end());
  auto at = [&](double q) { return micros[static_cast<size_t>(q * (micros.size() - 1))]; };
  return {{"wake", by_socket ? "socket" : "futex doorbell"},
          {"round_trips", count},
          {"p50_us", at(0.5)},
          {"p90_us", at(0.9)},
          {"p99_us", at(0.99)}};
}

}  // namespace

int main(int argc, char** argv) {
  int count = 20000, rounds = 3;
  CLI::App app{"symbiosis-bench-wake: waking a sleeping scheduler, futex doorbell against wake socket"};
  app.add_option("--round-trips", count, "round trips a measurement")->capture_default_str();
  app.add_option("--rounds", rounds, "measurements of each, alternated")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  for (int round = 0; round < rounds; ++round) {
    for (const bool by_socket : {false, true}) std::cout << measure(by_socket, count).dump() << std::endl;
  }
}
