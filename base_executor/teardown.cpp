// [Teardown off the front door] (teardown.h).
#include "base_executor/teardown.h"

#include <string>

#include "common/slow_scope.h"

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
    {
      const SlowScope slow("client " + std::to_string(channel->client_id()) + ": its teardown");
      channel->abort();
      channel.reset();
    }
    lock.lock();
  }
}

}  // namespace symbiosis
