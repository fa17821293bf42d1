// [Admission] and [Untrusted input]: an executor with keys serves only the tenants its keys folder
// lists, tells every other peer why in a few words, encrypts what crosses the wire, keeps
// statistics for operators, and takes revocations without a restart; and what strangers send is
// never echoed or logged whole.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "base_executor/admission.h"
#include "base_executor/executor.h"
#include "client_runtime/client.h"
#include "common/checkpoint.h"
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
    EXPECT_TRUE(
        at::allclose(client.forward(*client.find_layer(kQ), x, true), at::mm(x, checkpoint_->q.t()), 1e-6, 1e-6));
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
  // A key nobody listed, and a revoked one: refused in the handshake itself ([Admission]).
  for (const char* name : {"mallory", "bob"}) {
    error = testing::error_of([&] { Client::connect(as(name)); });
    EXPECT_TRUE(contains(error, "refused this client's key at the handshake (ZAP 400: not admitted or revoked)"))
        << error;
  }

  // Statistics are an operator's: a tenant is refused, an operator answered.
  error = testing::error_of([&] {
    request_stats(
        executor_->endpoint(), 5000,
        {keys::public_key((keys_ / "executor.pub").string()), keys::read(keys_ / "people" / "alice.key", true)});
  });
  EXPECT_TRUE(contains(error, "refused: statistics are for operators")) << error;
  const auto stats = request_stats(
      executor_->endpoint(), 5000,
      {keys::public_key((keys_ / "executor.pub").string()), keys::read(keys_ / "people" / "ops.key", true)});
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
  EXPECT_TRUE(contains(error,
                       "client options executor_key and key_file go together: executor_key is given without "
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

// A TCP socket listening on a free loopback port (its number in *port), with `backlog`.
int listen_on_loopback(int backlog, int* port) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), length), 0);
  EXPECT_EQ(::listen(listener, backlog), 0);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  *port = ntohs(address.sin_port);
  return listener;
}

// A TCP relay between a client and the executor that keeps every byte it passes on.
class Relay {
 public:
  explicit Relay(int executor_port) {
    listener_ = listen_on_loopback(4, &port_);
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
  ExecutorOptions large_frames;
  large_frames.max_message_bytes = size_t{32} << 20;  // lets the 16 MB Hello be read, to be refused
  executor_ = testing::start_executor(checkpoint_->dir, large_frames);
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

// ---- [Admission]: strangers cost nothing, a tenant is its key ----

// The resident memory of this process (the executor runs in it), from /proc/self/status.
int64_t resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// Peers with keys nobody admitted, each sending frames of `frame_bytes` (the largest the executor
// takes) on a connection, and again on a fresh one once refused, until destroyed. Every frame is
// one read-only mapping of zero pages (ZeroMQ copies none of it), so that what the strangers
// cost this process is not mistaken for what they cost the executor.
class Strangers {
 public:
  Strangers(const std::string& endpoint, const std::string& executor_key, int count, size_t frame_bytes)
      : frame_bytes_(frame_bytes),
        frames_(::mmap(nullptr, frame_bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) {
    EXPECT_NE(frames_, MAP_FAILED);
    for (int i = 0; i < count; ++i) threads_.emplace_back([=, this] { run(endpoint, executor_key, i); });
  }
  ~Strangers() {
    stop_ = true;
    for (auto& thread : threads_) thread.join();
    ::munmap(frames_, frame_bytes_);
  }
  int refused() const { return refused_; }    // handshakes refused with ZAP 400, as the strangers saw them
  int admitted() const { return admitted_; }  // handshakes that succeeded (none should)
  int64_t frames_sent() const { return sent_; }

 private:
  void run(const std::string& endpoint, const std::string& executor_key, int index) {
    const auto pair = keys::generate();
    for (int attempt = 0; !stop_; ++attempt) {
      zmq::socket_t socket(context_, zmq::socket_type::dealer);
      socket.set(zmq::sockopt::linger, 0);
      socket.set(zmq::sockopt::curve_serverkey, executor_key);
      socket.set(zmq::sockopt::curve_publickey, pair.public_key);
      socket.set(zmq::sockopt::curve_secretkey, pair.secret_key);
      const std::string watch = "inproc://stranger-" + std::to_string(index) + "-" + std::to_string(attempt);
      ASSERT_EQ(zmq_socket_monitor(socket.handle(), watch.c_str(),
                                   ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_SUCCEEDED),
                0);
      zmq::socket_t monitor(context_, zmq::socket_type::pair);
      monitor.set(zmq::sockopt::rcvtimeo, 2000);
      monitor.connect(watch);
      socket.connect(endpoint);
      for (int i = 0; i < 4; ++i) {
        zmq::message_t frame(frames_, frame_bytes_, nullptr, nullptr);
        if (socket.send(frame, zmq::send_flags::dontwait)) sent_++;
      }
      zmq::message_t event;
      if (!monitor.recv(event) || event.size() < 6) continue;
      uint16_t kind = 0;
      uint32_t value = 0;
      std::memcpy(&kind, event.data(), sizeof(kind));
      std::memcpy(&value, static_cast<const char*>(event.data()) + sizeof(kind), sizeof(value));
      if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && value == 400) refused_++;
      if (kind == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) admitted_++;
    }
  }

  const size_t frame_bytes_;
  void* const frames_;
  zmq::context_t context_{1};
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0}, admitted_{0};
  std::atomic<int64_t> sent_{0};
  std::vector<std::thread> threads_;
};

// What an executor running in this test's process may hold for eight strangers at once: ZeroMQ's
// per-connection buffers are kilobytes ([Admission]); a frame of theirs taken in would be 257 MiB.
constexpr int64_t kStrangersBound = int64_t{64} << 20;

// Issue 44: eight peers whose keys are not admitted, each sending frames as large as the executor
// takes (--max-message-bytes), again and again, beside an honest keyed tenant that trains over
// tcp. The executor refuses them in the handshake, so it never takes in a frame of theirs: it
// stays alive, holds less than kStrangersBound more meanwhile, and the tenant's training equals a
// monolithic run step for step.
TEST_F(AdmissionTest, StrangersWithTheirLargestFramesCostNothingAndAnHonestTenantStaysExact) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto checkpoint = Checkpoint::open(dir);
  ExecutorOptions options;
  options.keys_dir = keys_;
  executor_ = testing::start_executor(dir, options);
  auto alice = testing::connect(*executor_, *checkpoint, as("alice"));
  LoraConfig lora;
  lora.r = 4;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  lora.init_b_zero = false;
  auto split = testing::make_training_run(*checkpoint, alice, testing::lora_adapter(lora), {}, 1e-2, 1234);
  auto mono = testing::make_training_run(*checkpoint, nullptr, testing::lora_adapter(lora), {}, 1e-2, 1234);
  at::manual_seed(7);
  const auto ids = at::randint(0, 200, {2, 12}, at::kLong);
  testing::expect_same_training(split, mono, ids, 1, 1e-5);  // what training holds anyway, held before
  const auto errors_before = executor_->stats().errors;
  const int64_t before = resident_bytes();
  std::atomic<int64_t> peak{before};
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling) {
      peak = std::max<int64_t>(peak, resident_bytes());
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  {
    Strangers strangers(executor_->endpoint(), keys::public_key((keys_ / "executor.pub").string()), 8,
                        options.message_limit());
    testing::expect_same_training(split, mono, ids, 5, 1e-5);
    // Each stranger was refused a few times over (their monitors saw ZAP 400), and none got in.
    EXPECT_TRUE(testing::wait_until([&] { return strangers.refused() >= 8 * 3; }, std::chrono::seconds(30)))
        << strangers.refused() << " refusals";
    EXPECT_EQ(strangers.admitted(), 0);
    EXPECT_GE(strangers.frames_sent(), 8 * 3 * 4);
    sampling = false;
    sampler.join();
    // The operator sees them counted as refusals.
    EXPECT_GE(executor_->stats().errors - errors_before, static_cast<uint64_t>(strangers.refused()));
    std::printf(
        "[ measured ] %d refused handshakes of 8 strangers, %lld frames of %zu bytes queued; the executor's "
        "process grew by at most %lld KiB (bound: %lld KiB)\n",
        strangers.refused(), static_cast<long long>(strangers.frames_sent()), options.message_limit(),
        static_cast<long long>((peak - before) >> 10), static_cast<long long>(kStrangersBound >> 10));
  }
  EXPECT_LT(peak - before, kStrangersBound);
  // Alive, and the tenant trains on, exact; a newcomer with an admitted key is served.
  testing::expect_same_training(split, mono, ids, 1, 1e-5);
  EXPECT_EQ(testing::connect(*executor_, *checkpoint, as("ops"))->model_hash(), checkpoint->model_hash());
}

// Collects the log lines the executor writes.
class CollectingSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string text() {
    std::lock_guard<std::mutex> lock(mutex_);
    return text_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& message) override {
    text_.append(message.payload.data(), message.payload.size()).append("\n");
  }
  void flush_() override {}

 private:
  std::string text_;  // guarded by the sink's mutex (base_sink locks it around sink_it_)
};

// [Admission]: an unknown key and a revoked one are refused in the handshake, the client told so
// at once (not at its timeout), and the executor's log names the revoked key; a key revoked
// while its tenant is connected is refused at the tenant's next call, and at the handshake when
// it comes back.
TEST_F(AdmissionTest, UnknownAndRevokedKeysAreRefusedAtTheHandshakeNamingTheRefusal) {
  start();
  auto sink = std::make_shared<CollectingSink>();
  spdlog::default_logger()->sinks().push_back(sink);
  for (const char* name : {"mallory", "bob"}) {
    const auto started = std::chrono::steady_clock::now();
    const auto error = testing::error_of([&] { Client::connect(as(name)); });
    EXPECT_TRUE(contains(error, "the executor at " + executor_->endpoint() +
                                    " refused this client's key at the handshake (ZAP 400: not admitted or revoked)"))
        << error;
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(4));  // well within the 5 s timeout
  }
  // An operator's request with a key that is not one's is refused the same way.
  auto error = testing::error_of([&] {
    request_stats(
        executor_->endpoint(), 5000,
        {keys::public_key((keys_ / "executor.pub").string()), keys::read(keys_ / "people" / "mallory.key", true)});
  });
  EXPECT_TRUE(contains(error, "refused this client's key at the handshake")) << error;
  EXPECT_EQ(executor_->stats().clients, 0u);

  auto alice = Client::connect(as("alice"));
  expect_exact(*alice);
  list("alice", "revoked");
  error = first_error(*alice);
  EXPECT_TRUE(contains(error, "refused: this client's key was revoked")) << error;
  error = testing::error_of([&] { Client::connect(as("alice")); });
  EXPECT_TRUE(contains(error, "refused this client's key at the handshake (ZAP 400")) << error;
  spdlog::default_logger()->sinks().pop_back();
  const auto log = sink->text();
  EXPECT_TRUE(contains(log, "refused at the handshake the revoked key 'bob'")) << log;
  EXPECT_TRUE(contains(log, "refused at the handshake the revoked key 'alice'")) << log;
  EXPECT_TRUE(contains(log, "refused at the handshake a key not admitted")) << log;
}

// The body of an HTTP GET of `url` (http://127.0.0.1:PORT/PATH), by hand.
std::string http_get(const std::string& url) {
  const auto host_at = url.find("://") + 3;
  const auto path_at = url.find('/', host_at);
  const auto port = std::stoi(url.substr(url.rfind(':', path_at) + 1, path_at));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = "GET " + url.substr(path_at) + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    (void)!::write(fd, request.data(), request.size());
    char buffer[65536];
    ssize_t got = 0;
    while ((got = ::read(fd, buffer, sizeof(buffer))) > 0) answer.append(buffer, static_cast<size_t>(got));
  }
  ::close(fd);
  const auto body = answer.find("\r\n\r\n");
  return body == std::string::npos ? "" : answer.substr(body + 4);
}

// Issue 44: with keys, a tenant is its key. A Hello that claims another admitted key's name is
// refused naming both; any other label gives way to the key's name, which is what statistics,
// metrics and logs count.
TEST_F(AdmissionTest, WithKeysATenantIsNamedByItsKeyAndCannotClaimAnothersName) {
  list("mallory", "tenants");
  ExecutorOptions options;
  options.keys_dir = keys_;
  options.metrics_listen = "127.0.0.1:0";
  executor_ = testing::start_executor(checkpoint_->dir, options);
  auto sink = std::make_shared<CollectingSink>();
  spdlog::default_logger()->sinks().push_back(sink);

  auto impostor = as("mallory");
  impostor.tenant = "alice";
  const auto error = testing::error_of([&] { Client::connect(impostor); });
  EXPECT_TRUE(contains(error, "PERMISSION_DENIED")) << error;
  EXPECT_TRUE(contains(error, "Hello says tenant 'alice', the name of another admitted key, but its key is 'mallory'"))
      << error;

  auto labelled = as("mallory");
  labelled.tenant = "team-m";
  auto mallory = Client::connect(labelled);
  auto unnamed = as("alice");
  unnamed.tenant = "";
  auto alice = Client::connect(unnamed);
  auto alice_again = Client::connect(as("alice"));  // says its own name: fine
  expect_exact(*mallory);
  expect_exact(*alice);
  expect_exact(*alice_again);
  expect_exact(*alice_again);

  std::string metrics;
  EXPECT_TRUE(testing::wait_until(
      [&] {
        metrics = http_get(executor_->metrics_url());
        return contains(metrics, "symbiosis_tenant_requests_total{tenant=\"alice\"} 3\n") &&
               contains(metrics, "symbiosis_tenant_requests_total{tenant=\"mallory\"} 1\n");
      },
      std::chrono::seconds(10)))
      << metrics;
  EXPECT_FALSE(contains(metrics, "team-m")) << metrics;
  spdlog::default_logger()->sinks().pop_back();
  const auto log = sink->text();
  EXPECT_TRUE(contains(log,
                       "a client with key 'mallory' says tenant 'team-m'; with keys a tenant is named by its "
                       "key: 'mallory'"))
      << log;
  EXPECT_TRUE(contains(log, "(tenant 'mallory', by its key")) << log;
  EXPECT_FALSE(contains(log, "(tenant 'team-m'")) << log;
}

// [Admission]: a connection that never finishes its handshake is dropped after the handshake
// interval, whatever it does (here: nothing), and the executor serves on.
// A plain TCP connection to the executor's port, as a hand-made peer would open; -1 on failure.
int connect_raw(const std::string& endpoint) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port_of(endpoint)));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) return fd;
  ::close(fd);
  return -1;
}

TEST_F(AdmissionTest, AConnectionThatNeverFinishesItsHandshakeIsDropped) {
  start();
  const int fd = connect_raw(executor_->endpoint());
  ASSERT_GE(fd, 0);
  bool closed = false;
  const auto deadline = std::chrono::steady_clock::now() + kHandshakeInterval + std::chrono::seconds(5);
  while (!closed && std::chrono::steady_clock::now() < deadline) {
    pollfd item{fd, POLLIN, 0};
    if (::poll(&item, 1, 100) <= 0) continue;
    char buffer[256];
    closed = ::read(fd, buffer, sizeof(buffer)) <= 0;  // the executor's greeting comes first
  }
  ::close(fd);
  EXPECT_TRUE(closed) << "the executor kept a connection that never finished its handshake";
  expect_exact(*Client::connect(as("alice")));
}

// Issue 44, [Bounded frames] (transport/zmq_wire.h): a hand-made peer, no key needed, sends a CURVE
// greeting and then announces a 64 MiB handshake command and sends it. ZeroMQ decodes handshake
// commands under the executor's frame limit (1 MiB + 64 KiB), so the connection is cut at the
// announcement: the peer gets little of it across (what the kernel's socket buffers took), the
// executor holds none of it, and it serves on. With a frame limit as large as a request, the
// executor took in all 64 MiB and held it until the handshake interval passed.
TEST_F(AdmissionTest, AHandMadePeersHugeHandshakeCommandIsCutOffAtTheFrameLimit) {
  start();
  const int fd = connect_raw(executor_->endpoint());
  ASSERT_GE(fd, 0);
  // ZMTP 3.0: signature, version, mechanism (20 bytes), as-server, filler; then a long command frame.
  std::vector<uint8_t> greeting(64, 0);
  greeting[0] = 0xff;
  greeting[9] = 0x7f;
  greeting[10] = 3;
  std::memcpy(&greeting[12], "CURVE", 5);
  constexpr uint64_t kAnnounced = uint64_t{64} << 20;
  std::vector<uint8_t> header = {0x06};  // a command, with an 8-byte size
  for (int shift = 56; shift >= 0; shift -= 8) header.push_back(static_cast<uint8_t>(kAnnounced >> shift));
  ASSERT_EQ(::send(fd, greeting.data(), greeting.size(), MSG_NOSIGNAL), 64);
  ASSERT_EQ(::send(fd, header.data(), header.size(), MSG_NOSIGNAL), 9);
  const int64_t before = resident_bytes();
  const std::vector<char> chunk(size_t{64} << 10, 'x');
  uint64_t sent = 0;
  bool cut = false;
  const auto deadline = std::chrono::steady_clock::now() + kHandshakeInterval + std::chrono::seconds(5);
  while (!cut && sent < kAnnounced && std::chrono::steady_clock::now() < deadline) {
    pollfd item{fd, POLLOUT, 0};
    if (::poll(&item, 1, 100) <= 0) continue;
    const ssize_t n = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) sent += static_cast<uint64_t>(n);
    cut = n < 0 && errno != EAGAIN && errno != EWOULDBLOCK;
  }
  const int64_t grown = resident_bytes() - before;
  ::close(fd);
  std::printf(
      "[ measured ] the hand-made peer got %llu of its announced %llu bytes across before the cut; the "
      "executor's process grew by %lld KiB\n",
      static_cast<unsigned long long>(sent), static_cast<unsigned long long>(kAnnounced),
      static_cast<long long>(grown >> 10));
  EXPECT_TRUE(cut) << "the executor took " << sent << " bytes of a handshake command over its frame limit";
  EXPECT_LT(sent, uint64_t{16} << 20);
  EXPECT_LT(grown, kStrangersBound);
  expect_exact(*Client::connect(as("alice")));
}

// Issue 44, [Connections in handshake] (base_executor/connections.cpp): past --max-handshakes, the
// oldest connection still in handshake is cut, with a line in the log; the executor serves on.
TEST_F(AdmissionTest, PastMaxHandshakesTheOldestConnectionInHandshakeIsCut) {
  ExecutorOptions options;
  options.keys_dir = keys_;
  options.max_handshakes = 4;
  executor_ = testing::start_executor(checkpoint_->dir, options);
  auto sink = std::make_shared<CollectingSink>();
  spdlog::default_logger()->sinks().push_back(sink);
  std::vector<int> connections;
  for (int i = 0; i < 10; ++i) {
    connections.push_back(connect_raw(executor_->endpoint()));
    ASSERT_GE(connections.back(), 0);
  }
  auto closed = [](int fd) {
    pollfd item{fd, POLLIN, 0};
    char buffer[256];
    while (::poll(&item, 1, 0) > 0) {
      if (::read(fd, buffer, sizeof(buffer)) <= 0) return true;  // past the executor's greeting
    }
    return false;
  };
  // The first six went past the limit of four (the handshake interval would cut all ten, later).
  EXPECT_TRUE(testing::wait_until([&] { return std::all_of(connections.begin(), connections.begin() + 6, closed); },
                                  std::chrono::seconds(10)));
  spdlog::default_logger()->sinks().pop_back();
  for (const int fd : connections) ::close(fd);
  EXPECT_TRUE(contains(sink->text(), "more than 4 connections in handshake at once: cut the oldest")) << sink->text();
  expect_exact(*Client::connect(as("alice")));
}

// Something at an endpoint that is not an executor: a TCP listener that closes every connection
// at once, says nothing on it, or answers as a web server does.
class NotAnExecutor {
 public:
  enum class Behaviour { kCloses, kSilent, kWebServer };
  explicit NotAnExecutor(Behaviour behaviour) : behaviour_(behaviour) {
    listener_ = listen_on_loopback(16, &port_);
    thread_ = std::thread([this] { run(); });
  }
  ~NotAnExecutor() {
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
    for (const int fd : held_) ::close(fd);
  }
  std::string endpoint() const { return "tcp://127.0.0.1:" + std::to_string(port_); }

 private:
  void run() {
    while (true) {
      const int connection = ::accept(listener_, nullptr, nullptr);
      if (connection < 0) return;
      if (behaviour_ == Behaviour::kSilent) {
        held_.push_back(connection);
        continue;
      }
      if (behaviour_ == Behaviour::kWebServer) {
        pollfd item{connection, POLLIN, 0};
        char request[256];
        if (::poll(&item, 1, 1000) > 0) (void)!::read(connection, request, sizeof(request));
        const std::string answer = "HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
        (void)!::write(connection, answer.data(), answer.size());
      }
      ::close(connection);
    }
  }

  const Behaviour behaviour_;
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::vector<int> held_;  // the silent one's connections; the thread's until it is joined
};

// A ZeroMQ peer that answers every message with bytes that are not a symbiosis message.
class GarbageAnswerer {
 public:
  GarbageAnswerer() {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.bind("tcp://127.0.0.1:*");
    endpoint_ = socket_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] {
      while (!stop_) {
        zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
        zmq::poll(&item, 1, std::chrono::milliseconds(50));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        auto frames = wire::recv_all(socket_);
        socket_.send(frames.at(0), zmq::send_flags::sndmore);
        socket_.send(zmq::str_buffer("\xde\xad not a symbiosis message"), zmq::send_flags::none);
      }
    });
  }
  ~GarbageAnswerer() {
    stop_ = true;
    thread_.join();
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  zmq::context_t context_{1};
  zmq::socket_t socket_{context_, zmq::socket_type::router};
  std::string endpoint_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Issue 44: a client pointed at something that is not an executor is told what was seen there (no
// answer, an answer that is not a symbiosis message, a connection closed, a web server), never
// that an executor wants keys; only an executor that does is said to.
TEST_F(AdmissionTest, TheHandshakeErrorAtSomethingThatIsNotAnExecutorSaysWhatWasSeen) {
  auto keyless = [](const std::string& endpoint) {
    ClientOptions options;
    options.endpoint = endpoint;
    options.transport = "tcp";
    options.timeout_ms = 5000;
    options.connect_timeout_ms = 1500;
    return options;
  };
  auto expect_seen = [&](const std::string& endpoint, const ClientOptions& options, const std::string& seen) {
    const auto error = testing::error_of([&] { Client::connect(options); });
    EXPECT_TRUE(contains(error, endpoint)) << error;
    EXPECT_TRUE(contains(error, seen)) << error;
    EXPECT_TRUE(contains(error, "it is not a symbiosis executor") || contains(error, "is not a symbiosis executor:"))
        << error;
    EXPECT_FALSE(contains(error, "admits only tenants with keys")) << error;
    EXPECT_FALSE(contains(error, "is not that executor's")) << error;
  };
  {
    GarbageAnswerer garbage;
    expect_seen(garbage.endpoint(), keyless(garbage.endpoint()),
                "it answered the handshake with 1 frame(s) that are not a symbiosis message");
  }
  {
    NotAnExecutor closes(NotAnExecutor::Behaviour::kCloses);
    expect_seen(closes.endpoint(), keyless(closes.endpoint()), "closes a new connection without a byte");
    // With keys, the same: no talk of the wrong executor key.
    expect_seen(closes.endpoint(), as("alice", closes.endpoint()), "closes a new connection without a byte");
  }
  {
    NotAnExecutor silent(NotAnExecutor::Behaviour::kSilent);
    expect_seen(silent.endpoint(), keyless(silent.endpoint()),
                "accepted the connection but did not answer the handshake within 1500 ms, not even with ZeroMQ's "
                "greeting");
  }
  {
    NotAnExecutor web(NotAnExecutor::Behaviour::kWebServer);
    expect_seen(web.endpoint(), keyless(web.endpoint()),
                "answers a new connection with bytes that are not ZeroMQ (\"HTTP/1.0 400 Bad Request\")");
    expect_seen(web.endpoint(), as("alice", web.endpoint()), "bytes that are not ZeroMQ");
  }
  // An executor's own metrics port (HTTP), as a user might mistake it for the executor's.
  ExecutorOptions options;
  options.metrics_listen = "127.0.0.1:0";
  executor_ = testing::start_executor(checkpoint_->dir, options);
  const auto url = executor_->metrics_url();
  const auto metrics_port = "tcp://127.0.0.1:" + url.substr(url.rfind(':') + 1, url.find('/', 7) - url.rfind(':') - 1);
  expect_seen(metrics_port, keyless(metrics_port), "");
  // And the executor itself, with keys, keyless clients are told it wants keys (its greeting says CURVE).
  executor_.reset();
  start();
  for (int i = 0; i < 5; ++i) {
    const auto error = testing::error_of([&] { Client::connect(keyless(executor_->endpoint())); });
    EXPECT_TRUE(contains(error, "admits only tenants with keys")) << error;
  }
}

}  // namespace
}  // namespace symbiosis
