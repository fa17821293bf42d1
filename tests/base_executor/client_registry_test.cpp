// The client registry's liveness rules, on an injected clock and process table: a client of this
// host is gone when its process is; a ZeroMQ client when it has been silent past the idle limit;
// any client when its channel broke. And [Link closed last]: a forgotten client's local link,
// handed to its channel, closes only with the channel's last reference.
#include "base_executor/client_registry.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/socket.h>
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

// [Link closed last] (transport/channel.h): while the teardown still holds the channel (its
// destructor waits for the channel's GPU work), the client's end of the link sees no hang-up.
TEST_F(ClientRegistryTest, AForgottenClientsLinkClosesOnlyWithItsChannel) {
  int ends[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, ends), 0);
  const UniqueFd client_end(ends[1]);
  auto channel = tcp_channel(1);
  auto teardowns = channel;
  channel->close_link_when_gone(UniqueFd(ends[0]));
  channel.reset();
  pollfd look{client_end.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&look, 1, 0), 0) << "the link closed while the channel lived";
  teardowns.reset();
  ASSERT_EQ(::poll(&look, 1, 1000), 1) << "the link stayed open after the channel went";
  EXPECT_NE(look.revents & (POLLHUP | POLLIN), 0);
  char byte = 0;
  EXPECT_EQ(::read(client_end.get(), &byte, 1), 0) << "the client's end reads the close";
}

}  // namespace
}  // namespace symbiosis
