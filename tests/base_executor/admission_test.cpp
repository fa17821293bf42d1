// [Admission] and [Untrusted input]: an executor with keys serves only the tenants its keys folder
// lists, tells every other peer why in a few words, encrypts what crosses the wire, keeps
// statistics for operators, and takes revocations without a restart; and what strangers send is
// never echoed or logged whole.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "base_executor/executor.h"
#include "client_runtime/client.h"
#include "tests/test_util.h"
#include "transport/client_transport.h"
#include "transport/keys.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

constexpr const char* kQ = "model.layers.0.self_attn.q_proj";

class AdmissionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    checkpoint_ = new testing::TwoLayerCheckpoint(testing::write_two_layer_checkpoint("admission-test", 3, false));
  }

  void SetUp() override {
    keys_ = testing::temp_dir("admission-keys");
    keys::write(keys_ / "executor", keys::generate());
    for (const char* name : {"alice", "bob", "ops", "mallory"}) keys::write(keys_ / "people" / name, keys::generate());
    list("alice", "tenants");
    list("bob", "tenants");
    list("bob", "revoked");
    list("ops", "operators");
  }

  // Puts NAME's public key into the keys folder's `folder`.
  void list(const std::string& name, const std::string& folder) {
    std::filesystem::create_directories(keys_ / folder);
    std::filesystem::copy_file(keys_ / "people" / (name + ".pub"), keys_ / folder / (name + ".pub"),
                               std::filesystem::copy_options::overwrite_existing);
  }

  void start(bool with_keys = true) {
    ExecutorOptions options;
    if (with_keys) options.keys_dir = keys_;
    executor_ = testing::start_executor(checkpoint_->dir, options);
  }

  ClientOptions as(const std::string& name, const std::string& endpoint = "") {
    ClientOptions options;
    options.endpoint = endpoint.empty() ? executor_->endpoint() : endpoint;
    options.timeout_ms = 5000;
    options.transport = "tcp";
    options.tenant = name;
    options.executor_key = (keys_ / "executor.pub").string();
    options.key_file = (keys_ / "people" / (name + ".key")).string();
    return options;
  }

  static void expect_exact(Client& client) {
    const auto x = at::randn({3, 4});
    EXPECT_TRUE(at::allclose(client.forward(*client.find_layer(kQ), x, true), at::mm(x, checkpoint_->q.t()), 1e-6,
                             1e-6));
  }

  // The first error the client's calls meet within 10 s (the executor reads its keys every second).
  static std::string first_error(Client& client) {
    std::string error;
    testing::wait_until(
        [&] {
          error = testing::error_of([&] { expect_exact(client); });
          return error != "(no error)";
        },
        std::chrono::seconds(10));
    return error;
  }

  static testing::TwoLayerCheckpoint* checkpoint_;
  std::filesystem::path keys_;
  std::unique_ptr<Executor> executor_;
};
testing::TwoLayerCheckpoint* AdmissionTest::checkpoint_ = nullptr;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST_F(AdmissionTest, OnlyListedKeysAreServedAndEveryOtherPeerIsToldWhy) {
  start();
  auto alice = Client::connect(as("alice"));
  expect_exact(*alice);

  // No key at all.
  ClientOptions keyless = as("alice");
  keyless.executor_key.clear();
  keyless.key_file.clear();
  std::string error;
  for (int i = 0; i < 5; ++i) {  // however the executor's refusal of the handshake reaches the client
    error = testing::error_of([&] { Client::connect(keyless); });
    EXPECT_TRUE(contains(error, "admits only tenants with keys")) << error;
  }
  // The wrong executor key: the client encrypts for another server.
  ClientOptions wrong_server = as("alice");
  wrong_server.executor_key = (keys_ / "people" / "mallory.pub").string();
  for (int i = 0; i < 5; ++i) {
    error = testing::error_of([&] { Client::connect(wrong_server); });
    EXPECT_TRUE(contains(error, "the executor key this client was given is not that executor's")) << error;
  }
  // A key nobody listed, and a revoked one.
  error = testing::error_of([&] { Client::connect(as("mallory")); });
  EXPECT_TRUE(contains(error, "PERMISSION_DENIED")) << error;
  EXPECT_TRUE(contains(error, "refused: this client's key is not admitted here")) << error;
  error = testing::error_of([&] { Client::connect(as("bob")); });
  EXPECT_TRUE(contains(error, "refused: this client's key was revoked")) << error;

  // Statistics are an operator's: a tenant is refused, an operator answered.
  error = testing::error_of([&] {
    request_stats(executor_->endpoint(), 5000, {keys::public_key((keys_ / "executor.pub").string()),
                                                keys::read(keys_ / "people" / "alice.key", true)});
  });
  EXPECT_TRUE(contains(error, "refused: statistics are for operators")) << error;
  const auto stats = request_stats(executor_->endpoint(), 5000,
                                   {keys::public_key((keys_ / "executor.pub").string()),
                                    keys::read(keys_ / "people" / "ops.key", true)});
  EXPECT_EQ(stats.clients(), 1u);

  // The admitted tenant was not disturbed by any of it.
  expect_exact(*alice);
}

TEST_F(AdmissionTest, TheKeysFolderIsReadAgainWithoutARestartRevocationIncluded) {
  start();
  auto alice = Client::connect(as("alice"));
  expect_exact(*alice);
  // A new tenant is listed while the executor runs.
  list("mallory", "tenants");
  std::shared_ptr<Client> mallory;
  ASSERT_TRUE(testing::wait_until(
      [&] {
        try {
          mallory = Client::connect(as("mallory"));
          return true;
        } catch (const c10::Error&) {
          return false;
        }
      },
      std::chrono::seconds(10)));
  expect_exact(*mallory);
  // Alice's key is revoked: her next call is refused, saying so; mallory goes on.
  list("alice", "revoked");
  const auto error = first_error(*alice);
  EXPECT_TRUE(contains(error, "refused: this client's key was revoked")) << error;
  expect_exact(*mallory);
}

// A same-host tenant's calls come through its control segment, not through the front door: once
// its key is revoked, the executor refuses them there, saying why (not a silence until a timeout).
TEST_F(AdmissionTest, ARevokedSameHostTenantsCallsAreRefusedSayingWhy) {
  start();
  auto options = as("alice");
  options.transport = "shm";
  auto alice = Client::connect(options);
  ASSERT_EQ(alice->transport(), "shm");
  expect_exact(*alice);
  list("alice", "revoked");
  const auto error = first_error(*alice);
  EXPECT_TRUE(contains(error, "refused: this client's key was revoked")) << error;
}

// A keys folder or key file that does not read, and client options that do not go together, are
// refused naming the file or the field.
TEST_F(AdmissionTest, BadKeysAndKeyOptionsAreRefusedNamingWhatIsWrong) {
  std::filesystem::remove(keys_ / "executor.key");
  auto error = testing::error_of([&] { start(); });
  EXPECT_TRUE(contains(error, "has no executor.key: make one with `symbiosis-ctl keygen")) << error;
  std::filesystem::remove(keys_ / "executor.pub");
  keys::write(keys_ / "executor", keys::generate());
  std::ofstream(keys_ / "tenants" / "broken.pub") << "curve\n    public-key = \"not a key\"\n";
  error = testing::error_of([&] { start(); });
  EXPECT_TRUE(contains(error, "broken.pub has no well-formed public-key")) << error;
  error = testing::error_of([&] { keys::read(keys_ / "people" / "alice.pub", /*need_secret=*/true); });
  EXPECT_TRUE(contains(error, "has no well-formed secret-key: give the NAME.key file of the pair")) << error;
  error = testing::error_of([&] { keys::write(keys_ / "people" / "alice", keys::generate()); });
  EXPECT_TRUE(contains(error, "exists already")) << error;
  ClientOptions options;
  options.executor_key = (keys_ / "executor.pub").string();
  error = testing::error_of([&] { options.validate(); });
  EXPECT_TRUE(contains(error, "client options executor_key and key_file go together: executor_key is given without "
                              "the other"))
      << error;
}

TEST_F(AdmissionTest, WithoutKeysTheExecutorListensOnLoopbackOnlyUnlessToldInsecure) {
  ExecutorOptions options;
  options.model_dir = checkpoint_->dir;
  options.listen = "tcp://0.0.0.0:*";
  auto error = testing::error_of([&] { options.validate(); });
  EXPECT_TRUE(contains(error, "is reachable from other hosts, and without keys anyone there could use this executor"))
      << error;
  options.insecure = true;
  options.validate();
  options.insecure = false;
  options.keys_dir = keys_;
  options.validate();
  options.keys_dir.clear();
  options.listen = "tcp://127.0.0.1:*";
  options.validate();
  // A client with keys at an executor without them is told so.
  start(/*with_keys=*/false);
  for (int i = 0; i < 5; ++i) {
    const auto error = testing::error_of([&] { Client::connect(as("alice")); });
    EXPECT_TRUE(contains(error, "takes no keys")) << error;
  }
}

// A TCP relay between a client and the executor that keeps every byte it passes on.
class Relay {
 public:
  explicit Relay(int executor_port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&address), length), 0);
    EXPECT_EQ(::listen(listener_, 4), 0);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this, executor_port] { run(executor_port); });
  }
  ~Relay() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
  }
  std::string endpoint() const { return "tcp://127.0.0.1:" + std::to_string(port_); }
  std::string seen() {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }

 private:
  void run(int executor_port) {
    const int client = ::accept(listener_, nullptr, nullptr);
    if (client < 0) return;
    const int executor = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(executor_port));
    if (::connect(executor, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return;
    char buffer[65536];
    while (!stop_) {
      fd_set readable;
      FD_ZERO(&readable);
      FD_SET(client, &readable);
      FD_SET(executor, &readable);
      timeval tick{0, 50000};
      if (::select(std::max(client, executor) + 1, &readable, nullptr, nullptr, &tick) <= 0) continue;
      for (auto [from, to] : {std::pair{client, executor}, std::pair{executor, client}}) {
        if (!FD_ISSET(from, &readable)) continue;
        const ssize_t got = ::read(from, buffer, sizeof(buffer));
        if (got <= 0) {
          stop_ = true;
          break;
        }
        {
          std::lock_guard<std::mutex> lock(mutex_);
          seen_.append(buffer, static_cast<size_t>(got));
        }
        (void)!::write(to, buffer, static_cast<size_t>(got));
      }
    }
    ::close(client);
    ::close(executor);
  }

  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mutex_;
  std::string seen_;
};

// An activation whose bytes are easy to find: 64 floats, none of them a small integer.
at::Tensor known_activation() { return at::arange(64, at::kFloat).reshape({16, 4}).mul_(0.001f).add_(3.25f); }

int port_of(const std::string& endpoint) { return std::stoi(endpoint.substr(endpoint.rfind(':') + 1)); }

TEST_F(AdmissionTest, AKnownActivationNeverAppearsOnTheWireWithKeysAndDoesWithout) {
  const auto x = known_activation();
  const std::string needle(static_cast<const char*>(x.data_ptr()), 64);  // its first 16 floats
  for (const bool with_keys : {true, false}) {
    start(with_keys);
    Relay relay(port_of(executor_->endpoint()));
    auto options = as("alice", relay.endpoint());
    if (!with_keys) {
      options.executor_key.clear();
      options.key_file.clear();
    }
    auto client = Client::connect(options);
    const auto y = client->forward(*client->find_layer(kQ), x, true);
    EXPECT_TRUE(at::allclose(y, at::mm(x, checkpoint_->q.t()), 1e-6, 1e-6));
    client.reset();
    const auto seen = relay.seen();
    EXPECT_GT(seen.size(), 1024u);
    // The control run shows the relay would see it: the test can fail.
    EXPECT_EQ(contains(seen, needle), !with_keys) << (with_keys ? "with keys" : "without keys");
    executor_.reset();
  }
}

// Counts the log lines the executor writes.
class CountingSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::atomic<size_t> lines{0};
  std::atomic<size_t> longest{0};

 protected:
  void sink_it_(const spdlog::details::log_msg& message) override {
    lines++;
    longest = std::max<size_t>(longest, message.payload.size());
  }
  void flush_() override {}
};

TEST_F(AdmissionTest, NothingAStrangerSendsIsEchoedOrLoggedWholeAndBadInputLogsAreRateLimited) {
  start(/*with_keys=*/false);
  zmq::context_t context(1);
  zmq::socket_t socket(context, zmq::socket_type::dealer);
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::rcvtimeo, 10000);
  socket.connect(executor_->endpoint());
  auto hello = [] {
    proto::Envelope env;
    env.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
    env.mutable_hello()->set_transport("tcp");
    return env;
  };
  // A 1 MB model hash comes back as a short prefix.
  auto big_hash = hello();
  big_hash.mutable_hello()->set_expected_model_hash(std::string(1 << 20, 'h'));
  auto answer = testing::exchange(socket, big_hash);
  ASSERT_TRUE(answer.has_error());
  EXPECT_TRUE(contains(answer.error().message(), "model mismatch")) << answer.error().message().substr(0, 200);
  EXPECT_LT(answer.error().message().size(), 400u);
  EXPECT_FALSE(contains(answer.error().message(), checkpoint_->dir.string())) << "the checkpoint's path is echoed";
  // A 16 MB tenant name is refused, not kept.
  auto big_tenant = hello();
  big_tenant.mutable_hello()->set_tenant(std::string(16 << 20, 't'));
  answer = testing::exchange(socket, big_tenant);
  ASSERT_TRUE(answer.has_error());
  EXPECT_TRUE(contains(answer.error().message(), "Hello.tenant of 16777216 bytes is over the limit of 128 bytes"))
      << answer.error().message().substr(0, 200);
  // An unknown transport name is quoted in part.
  auto odd_transport = hello();
  odd_transport.mutable_hello()->set_transport(std::string(100000, 'x'));
  answer = testing::exchange(socket, odd_transport);
  ASSERT_TRUE(answer.has_error());
  EXPECT_LT(answer.error().message().size(), 400u);

  // A flood of messages with invalid UTF-8 (each a Protobuf log line, and a refusal) writes a
  // bounded number of lines.
  auto sink = std::make_shared<CountingSink>();
  spdlog::default_logger()->sinks().push_back(sink);
  auto bad = hello();
  bad.mutable_hello()->set_tenant("ok");
  std::string bytes = wire::serialize(bad).to_string();
  const auto at = bytes.find("ok");
  ASSERT_NE(at, std::string::npos);
  bytes[at] = static_cast<char>(0xff);  // no longer UTF-8
  for (int i = 0; i < 1000; ++i) {
    socket.send(zmq::buffer(bytes), zmq::send_flags::none);
    auto frames = wire::recv_all(socket);
    proto::Envelope refusal;
    ASSERT_TRUE(wire::parse(frames.at(0), &refusal));
    ASSERT_TRUE(refusal.has_error());
  }
  spdlog::default_logger()->sinks().pop_back();
  EXPECT_GT(sink->lines.load(), 0u);
  EXPECT_LE(sink->lines.load(), 50u);
  EXPECT_LT(sink->longest.load(), 400u);
  // And the executor serves the next client.
  ClientOptions options;
  options.endpoint = executor_->endpoint();
  options.timeout_ms = 5000;
  auto client = Client::connect(options);
  expect_exact(*client);
}

}  // namespace
}  // namespace symbiosis
