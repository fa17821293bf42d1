// [Teardown off the front door] (teardown.h).
#include "base_executor/teardown.h"

#include <spdlog/spdlog.h>

#include <chrono>

namespace symbiosis {

Teardown::Teardown() : thread_([this] { run(); }) {}

Teardown::~Teardown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Teardown::hand_over(std::shared_ptr<Channel> channel) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    channels_.push_back(std::move(channel));
  }
  wake_.notify_one();
}

void Teardown::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || !channels_.empty(); });
    if (channels_.empty()) return;  // stopping, and nothing left
    auto channel = std::move(channels_.front());
    channels_.pop_front();
    lock.unlock();
    const auto started = std::chrono::steady_clock::now();
    const uint64_t id = channel->client_id();
    channel->abort();
    channel.reset();
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started);
    if (took >= std::chrono::milliseconds(100)) spdlog::warn("client {}: its teardown took {} ms", id, took.count());
    lock.lock();
  }
}

}  // namespace symbiosis
