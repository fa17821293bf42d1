// The client registry's liveness rules, on an injected clock and process table: a client of this
// host is gone when its process is; a ZeroMQ client when it has been silent past the idle limit;
// any client when its channel broke.
#include "base_executor/client_registry.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <set>

namespace symbiosis {
namespace {

class ClientRegistryTest : public ::testing::Test {
 protected:
  ClientRegistryTest()
      : registry_(ClientRegistry::Options{std::chrono::seconds(60), [this] { return now_; },
                                          [this](int pid) { return alive_.count(pid) > 0; }}) {}

  std::shared_ptr<Channel> tcp_channel(uint64_t id) {
    ChannelContext context;
    context.client_id = id;
    return plugin(TransportKind::kTcp).make_channel(context);
  }

  ClientRegistry::Clock::time_point now_ = ClientRegistry::Clock::time_point() + std::chrono::hours(1);
  std::set<int> alive_;
  ClientRegistry registry_;
};

TEST_F(ClientRegistryTest, GivesIdsInOrderAndASecondHelloStartsAfresh) {
  EXPECT_EQ(registry_.next_id(), 1u);
  EXPECT_EQ(registry_.add("a", "tenant-a", TransportKind::kTcp, 0, tcp_channel(1)).id, 1u);
  EXPECT_EQ(registry_.add("b", "tenant-b", TransportKind::kTcp, 0, tcp_channel(2)).id, 2u);
  EXPECT_EQ(registry_.size(), 2u);
  ASSERT_TRUE(registry_.remove("a"));
  EXPECT_EQ(registry_.add("a", "tenant-a", TransportKind::kTcp, 0, tcp_channel(3)).id, 3u);
  EXPECT_EQ(registry_.find("a")->tenant, "tenant-a");
  EXPECT_FALSE(registry_.remove("nobody"));
}

TEST_F(ClientRegistryTest, AZmqClientIsGoneOnlyAfterTheIdleLimitOfSilence) {
  registry_.add("quiet", "t", TransportKind::kTcp, 0, tcp_channel(1));
  registry_.add("talker", "t", TransportKind::kTcp, 0, tcp_channel(2));
  now_ += std::chrono::seconds(59);
  EXPECT_TRUE(registry_.gone().empty());
  ASSERT_NE(registry_.seen("talker"), nullptr);  // a message: a sign of life
  now_ += std::chrono::seconds(2);
  EXPECT_EQ(registry_.gone(), std::vector<std::string>{"quiet"});
  now_ += std::chrono::seconds(59);
  EXPECT_EQ(registry_.gone().size(), 2u);
}

TEST_F(ClientRegistryTest, AClientOfThisHostIsGoneWhenItsProcessIs) {
  alive_ = {100, 200};
  registry_.add("p100", "t", TransportKind::kShm, 100, tcp_channel(1));
  registry_.add("p200", "t", TransportKind::kShm, 200, tcp_channel(2));
  now_ += std::chrono::hours(5);  // silence does not matter for a watched process
  EXPECT_TRUE(registry_.gone().empty());
  alive_.erase(200);
  EXPECT_EQ(registry_.gone(), std::vector<std::string>{"p200"});
}

TEST(ClientRegistryProcess, ThisProcessIsAliveAndAnUnusedPidIsNot) {
  EXPECT_TRUE(ClientRegistry::default_process_alive(::getpid()));
  EXPECT_FALSE(ClientRegistry::default_process_alive(0x3ffffff0));  // above pid_max
}

}  // namespace
}  // namespace symbiosis
