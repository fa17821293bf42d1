// Same-host clients ([Shared-memory control channel]): the transport chosen by placement, exact
// results over shared memory, payload buffers that grow, a precise error for every bad call
// header, and an executor that survives clients that corrupt their ring or die mid-request.
#include <fcntl.h>
#include <linux/capability.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "base_executor/executor.h"
#include "bench/process.h"
#include "client_runtime/client.h"
#include "client_runtime/training/step_graph.h"
#include "common/checkpoint.h"
#include "tests/test_util.h"
#include "transport/call_ring.h"
#include "transport/local_socket.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;

class SameHostTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    checkpoint_ = new testing::TwoLayerCheckpoint(testing::write_two_layer_checkpoint("same-host-test", 3, false));
  }

  void SetUp() override {
    ExecutorOptions options;
    options.max_request_bytes = size_t{64} << 20;
    executor_ = testing::start_executor(checkpoint_->dir, options);
  }

  std::shared_ptr<Client> connect(const std::string& transport, const std::string& control = "auto") {
    ClientOptions options;
    options.endpoint = executor_->endpoint();
    options.timeout_ms = 10000;
    options.transport = transport;
    options.control = control;
    return Client::connect(options);
  }

  static const at::Tensor& q_weight() { return checkpoint_->q; }
  static const at::Tensor& up_weight() { return checkpoint_->up_weight; }
  static const at::Tensor& up_bias() { return checkpoint_->up_bias; }
  static testing::TwoLayerCheckpoint* checkpoint_;
  std::unique_ptr<Executor> executor_;
};
testing::TwoLayerCheckpoint* SameHostTest::checkpoint_ = nullptr;

// A Hello asking for shm from process `pid` of this host, as a CPU client.
proto::Envelope shm_hello(pid_t pid, const std::string& control = "auto") {
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_transport("shm");
  hello.mutable_hello()->mutable_placement()->set_host_id(shm::host_id());
  hello.mutable_hello()->mutable_placement()->set_pid(pid);
  hello.mutable_hello()->mutable_placement()->set_device("cpu");
  hello.mutable_hello()->set_control(control);
  return hello;
}

// What a real client never does: speaks the control channel by hand.
struct RawShmPeer {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::dealer};
  shm::SharedMemory control, payload;
  UniqueFd link, wake;  // wake: [Wake sockets]
  shm::ControlBlock* block = nullptr;

  // control "zmq": headers go over ZeroMQ, and there is no control segment to map.
  explicit RawShmPeer(const std::string& endpoint, const std::string& control = "auto") {
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::rcvtimeo, 10000);
    socket.connect(endpoint);
    auto peer = testing::hello_and_prove(socket, shm_hello(::getpid(), control));
    const auto& welcome = peer.answer;
    EXPECT_TRUE(welcome.has_welcome()) << welcome.DebugString();
    EXPECT_EQ(welcome.welcome().transport(), "shm");
    EXPECT_EQ(welcome.welcome().control_channel(), control != "zmq");
    link = std::move(peer.link);
    if (control != "zmq") {
      this->control =
          shm::SharedMemory::map_descriptor(std::move(peer.descriptors.at(0)), sizeof(shm::ControlBlock), "control");
      wake = std::move(peer.descriptors.at(1));
      block = shm::map_block<shm::ControlBlock>(this->control);
    }
    payload = shm::SharedMemory::create("test-payload", 4096);
    auto registered = register_buffer(1);
    EXPECT_TRUE(registered.has_buffer_registered()) << registered.DebugString();
  }

  // A set-up message, on the proven link.
  proto::Envelope exchange(const proto::Envelope& env) { return testing::setup_exchange(socket, link.get(), env); }

  proto::Envelope register_buffer(uint64_t generation) {
    proto::Envelope env;
    env.mutable_register_buffer()->set_generation(generation);
    env.mutable_register_buffer()->set_bytes(payload.size());
    return testing::setup_exchange(socket, link.get(), env, payload.descriptor());
  }

  // A FORWARD of layer 1 (q_proj, in 4, out 8; ids follow sorted names) in fp32 with one token,
  // unless changed by `edit`.
  template <typename Edit>
  shm::CallRecord call(Edit&& edit) {
    shm::CallRecord r;
    auto& h = r.header;
    h.request_id = next_id++;
    h.layer_id = 1;
    h.op = proto::FORWARD;
    h.dtype = proto::FLOAT32;
    h.latency_class = proto::FINE_TUNING;
    h.tokens = 1;
    h.features = 4;
    h.in_offset = 0;
    h.out_offset = 256;
    h.buffer_generation = 1;
    edit(h);
    EXPECT_TRUE(block->requests.push(r));
    shm::wake_executor(*block, wake.get());
    EXPECT_TRUE(shm::wait_until(
        block->replies.wait(), [&] { return !block->replies.empty(); }, std::chrono::microseconds(50),
        Clock::now() + std::chrono::seconds(10)));
    return *block->replies.pop();
  }

  std::string error_of(std::function<void(shm::CallHeader&)> edit) {
    auto reply = call(edit);
    return reply.error_code == proto::OK ? "" : reply.message_text();
  }

  // The same call as a ZeroMQ Request (with a payload frame of its bytes when asked); returns the
  // error message of the Reply, "" for OK.
  std::string zmq_error_of(std::function<void(proto::Request&)> edit, bool with_frame = false) {
    proto::Envelope env;
    auto* r = env.mutable_request();
    r->set_request_id(next_id++);
    r->set_layer_id(1);
    r->set_op(proto::FORWARD);
    r->set_dtype(proto::FLOAT32);
    r->add_shape(1);
    r->add_shape(4);
    r->set_out_offset(256);
    r->set_buffer_generation(1);
    edit(*r);
    socket.send(wire::serialize(env), with_frame ? zmq::send_flags::sndmore : zmq::send_flags::none);
    if (with_frame) socket.send(zmq::message_t(16), zmq::send_flags::none);
    auto frames = wire::recv_all(socket);
    proto::Envelope answer;
    EXPECT_TRUE(!frames.empty() && wire::parse(frames[0], &answer) && answer.has_reply()) << answer.DebugString();
    EXPECT_EQ(answer.reply().request_id(), r->request_id());
    return answer.reply().has_error() ? answer.reply().error().message() : "";
  }

  uint64_t next_id = 1;
};

TEST_F(SameHostTest, AutoPicksSharedMemoryOnThisHostAndEveryTransportComputesExactly) {
  auto shm_client = connect("auto");
  EXPECT_EQ(shm_client->transport(), "shm");
  auto tcp_client = connect("tcp");
  EXPECT_EQ(tcp_client->transport(), "tcp");
  EXPECT_EQ(executor_->stats().same_host_clients, 1u);
  for (const auto& client : {shm_client, tcp_client}) {
    const auto* q = client->find_layer("model.layers.0.self_attn.q_proj");
    const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
    ASSERT_TRUE(q && up);
    for (int64_t tokens : {1, 5, 300}) {
      auto x = at::randn({tokens, 4});
      EXPECT_TRUE(at::allclose(client->forward(*q, x, true), at::mm(x, q_weight().t()), 1e-6, 1e-6));
      EXPECT_TRUE(at::allclose(client->forward(*up, x, true), at::addmm(up_bias(), x, up_weight().t()), 1e-6, 1e-6));
      EXPECT_TRUE(at::allclose(client->forward(*up, x, false), at::mm(x, up_weight().t()), 1e-6, 1e-6));
      auto g = at::randn({tokens, 6});
      EXPECT_TRUE(at::allclose(client->backward_input(*up, g), at::mm(g, up_weight()), 1e-6, 1e-6));
    }
  }
}

// [Shutdown notice]: a same-host client hears that the executor stops over ZeroMQ while it waits on
// its control segment (or, with control "zmq", where its answers come); its next call fails at
// once with that, not after its call timeout (it does not reconnect here: [Executor restart]).
TEST_F(SameHostTest, AStoppedExecutorFailsSameHostCallsAtOnce) {
  ClientOptions options;
  options.endpoint = executor_->endpoint();
  options.timeout_ms = 60000;
  options.reconnect_ms = 0;
  options.transport = "shm";
  auto through_segment = Client::connect(options);
  options.control = "zmq";
  auto through_zmq = Client::connect(options);
  const auto x = at::randn({3, 4});
  for (const auto& client : {through_segment, through_zmq}) {
    client->forward(*client->find_layer("model.layers.0.mlp.up_proj"), x, true);
  }
  executor_->shutdown();
  const auto start = Clock::now();
  for (const auto& client : {through_segment, through_zmq}) {
    const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
    for (int call = 0; call < 2; ++call) {
      const auto message = testing::error_of([&] { client->forward(*up, x, true); });
      EXPECT_NE(message.find("the executor at " + options.endpoint + " shut down"), std::string::npos) << message;
    }
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(15));  // a user-visible bound, not a timing
}

TEST_F(SameHostTest, PayloadBufferGrowsForLargerCalls) {
  auto client = connect("shm");
  const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
  // 2^20 tokens x 4 features x 4 bytes = 16 MiB in, 24 MiB out: past the first 4 MiB buffer.
  for (int64_t tokens : {int64_t{3}, int64_t{1} << 20, int64_t{7}}) {
    auto x = at::randn({tokens, 4});
    EXPECT_TRUE(at::allclose(client->forward(*up, x, true), at::addmm(up_bias(), x, up_weight().t()), 1e-5, 1e-5));
  }
}

TEST_F(SameHostTest, TransportsThePlacementCannotCarryAreRefusedWithTheReason) {
  auto refusal = [&](const std::string& transport) {
    try {
      connect(transport);
      return std::string("(connected)");
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
  };
  EXPECT_NE(
      refusal("cuda-ipc").find("transport cuda-ipc is not possible here: it needs the client on the executor's GPU"),
      std::string::npos)
      << refusal("cuda-ipc");
  EXPECT_NE(refusal("nccl").find("transport nccl is not possible here: it needs the client and the executor on two "
                                 "different GPUs"),
            std::string::npos)
      << refusal("nccl");
  EXPECT_NE(refusal("carrier-pigeon").find("client option transport 'carrier-pigeon' is not one of"),
            std::string::npos);
  try {
    connect("shm", "semaphore");
    ADD_FAILURE() << "an unknown control was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("client option control 'semaphore' is not one of auto, zmq"),
              std::string::npos)
        << e.what_without_backtrace();
  }

  // A client on another host may not ask for shared memory.
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::dealer};
  socket.set(zmq::sockopt::rcvtimeo, 10000);
  socket.connect(executor_->endpoint());
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_transport("shm");
  hello.mutable_hello()->mutable_placement()->set_host_id("elsewhere/0000");
  socket.send(wire::serialize(hello), zmq::send_flags::none);
  auto frames = wire::recv_all(socket);
  proto::Envelope answer;
  ASSERT_TRUE(wire::parse(frames.at(0), &answer));
  ASSERT_TRUE(answer.has_error());
  EXPECT_NE(answer.error().message().find("the client is on another host (elsewhere/0000"), std::string::npos)
      << answer.error().message();

  // The executor checks the control it is asked for, too.
  hello.mutable_hello()->mutable_placement()->set_host_id(shm::host_id());
  hello.mutable_hello()->set_control("semaphore");
  socket.send(wire::serialize(hello), zmq::send_flags::none);
  frames = wire::recv_all(socket);
  ASSERT_TRUE(wire::parse(frames.at(0), &answer));
  ASSERT_TRUE(answer.has_error());
  EXPECT_NE(answer.error().message().find("unknown control 'semaphore' (expected auto or zmq)"), std::string::npos)
      << answer.error().message();
}

// What comes on the local socket is checked like what comes over ZeroMQ: each wrong message is
// refused naming what was expected, and the client goes on.
TEST_F(SameHostTest, EveryBadLocalSocketMessageIsRefusedNamingWhatWasExpected) {
  RawShmPeer peer(executor_->endpoint());
  // A RegisterBuffer of an shm client without its segment.
  proto::Envelope registration;
  registration.mutable_register_buffer()->set_generation(2);
  registration.mutable_register_buffer()->set_bytes(4096);
  auto answer = peer.exchange(registration);
  ASSERT_TRUE(answer.has_error());
  EXPECT_NE(answer.error().message().find("a set-up message with 0 descriptors (expected 1)"), std::string::npos)
      << answer.error().message();
  // Anything but set-up.
  proto::Envelope goodbye;
  goodbye.mutable_goodbye();
  answer = peer.exchange(goodbye);
  ASSERT_TRUE(answer.has_error());
  EXPECT_NE(answer.error().message().find("the local link takes RegisterBuffer, ShareSegments and NcclSetup"),
            std::string::npos)
      << answer.error().message();
  // A connection whose first message is not a proof.
  const auto challenge = testing::exchange(peer.socket, shm_hello(::getpid()));
  ASSERT_TRUE(challenge.has_prove_host());
  auto connection = local::connect(challenge.prove_host().local_socket());
  ASSERT_TRUE(connection.is_ok());
  local::send(connection.value().get(), shm_hello(::getpid()));
  ASSERT_TRUE(local::readable(connection.value().get(), 10000));
  auto refusal = local::receive(connection.value().get());
  ASSERT_TRUE(refusal.is_ok() && refusal.value());
  EXPECT_NE(refusal.value()->envelope.error().message().find("the first message on the local socket must be Prove"),
            std::string::npos);
}

TEST_F(SameHostTest, EveryBadCallHeaderGetsAnErrorNamingTheProblem) {
  RawShmPeer peer(executor_->endpoint());
  auto contains = [](const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; };
  // A good call first: the raw peer gets q_proj of its payload.
  auto x = at::randn({1, 4});
  std::memcpy(peer.payload.data(), x.data_ptr(), 16);
  ASSERT_EQ(peer.error_of([](shm::CallHeader&) {}), "");
  auto y = at::from_blob(static_cast<char*>(peer.payload.data()) + 256, {1, 8});
  EXPECT_TRUE(at::allclose(y, at::mm(x, q_weight().t()), 1e-6, 1e-6));

  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.layer_id = 9; }), "unknown layer id 9"));
  EXPECT_TRUE(
      contains(peer.error_of([](auto& h) { h.op = 42; }), "op 42 is not FORWARD, BACKWARD_INPUT or FORWARD_NO_BIAS"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.dtype = proto::BFLOAT16; }),
                       "dtype BFLOAT16 does not match the layer's FLOAT32"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.features = 5; }), "shape [1, 5] should be [tokens >= 1, 4]"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.tokens = 0; }), "shape [0, 4] should be [tokens >= 1, 4]"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.tokens = int64_t{1} << 30; }), "exceed the executor's limit"));
  // A size whose byte count overflows 64 bits is still refused.
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.tokens = int64_t{1} << 62; }), "exceed the executor's limit"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.buffer_generation = 2; }),
                       "names payload buffer generation 2, but generation 1 is registered"));
  EXPECT_TRUE(
      contains(peer.error_of([](auto& h) { h.out_offset = 4090; }), "lies outside the 4096-byte payload buffer"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.in_offset = uint64_t{1} << 63; }), "lies outside"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.out_offset = 0; }), "input and output regions overlap"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.out_offset = 250; }), "multiples of 16 bytes"));
  // [Direct operands]: only a cuda-ipc client shares segments of its own memory.
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.in_segment = 5; }),
                       "input names segment 5, which the client has not shared (send ShareSegments first)"));
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.out_segment = 3; }), "output names segment 3"));
  proto::Envelope share;
  share.mutable_share_segments()->add_release(1);
  const auto refused = peer.exchange(share);
  ASSERT_TRUE(refused.has_error());
  // [Transport set-up]: a transport's own set-up message is refused by any other, naming both.
  EXPECT_TRUE(contains(refused.error().message(),
                       "ShareSegments from a shm client: transport shm takes no such set-up message"))
      << refused.error().message();
  // Only a cuda-ipc call is answered by a flag ([Stream-ordered hand-off]).
  EXPECT_TRUE(contains(peer.error_of([](auto& h) { h.sequence = 7; }),
                       "is numbered (sequence 7), but a shm call is answered by reply: send it with sequence 0"));
  // Every error named its request and layer; the executor still serves this client and others.
  EXPECT_TRUE(
      contains(peer.error_of([](auto& h) { h.features = 5; }), "for layer 1 (model.layers.0.self_attn.q_proj)"));
  EXPECT_EQ(peer.error_of([](shm::CallHeader&) {}), "");
  auto other = connect("shm");
  auto x2 = at::randn({2, 4});
  EXPECT_TRUE(at::allclose(other->forward(*other->find_layer("model.layers.0.self_attn.q_proj"), x2, true),
                           at::mm(x2, q_weight().t()), 1e-6, 1e-6));
  // Registrations must come in order.
  auto stale = peer.register_buffer(1);
  ASSERT_TRUE(stale.has_error());
  EXPECT_TRUE(contains(stale.error().message(), "RegisterBuffer generation 1, expected 2")) << stale.error().message();
}

// [Captured steps]: only a client on the executor's GPU, ordered through the control segment, can
// record its calls for a CUDA graph; a CPU client is told why, and a StepGraph on the CPU runs its
// step eagerly, as it was written.
TEST_F(SameHostTest, ACaptureIsRefusedOffTheGpuNamingWhyAndACpuStepRunsEagerly) {
  for (const std::string transport : {"shm", "tcp"}) {
    auto client = connect(transport);
    EXPECT_FALSE(client->can_capture()) << transport;
    try {
      client->begin_capture();
      ADD_FAILURE() << transport << ": a capture began";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("a captured step needs a client on the executor's GPU (transport cuda-ipc)"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find(transport == "tcp" ? "go over tcp" : "this shm client's calls are answered by reply"),
                std::string::npos)
          << message;
    }
    const auto* q = client->find_layer("model.layers.0.self_attn.q_proj");
    auto x = at::randn({2, 4});
    at::Tensor y;
    int computed = 0, applied = 0;
    StepGraph step(
        [&] {
          y = client->forward(*q, x, true);
          computed++;
        },
        [&] { applied++; }, client, at::kCPU);
    for (int i = 0; i < 3; ++i) step.run();
    EXPECT_FALSE(step.captured());
    EXPECT_EQ(computed, 3);
    EXPECT_EQ(applied, 3);
    EXPECT_TRUE(at::allclose(y, at::mm(x, q_weight().t()), 1e-6, 1e-6)) << transport;
  }
}

// A call the layer cannot take is refused by the client before it leaves, with the executor's
// reasons, whatever the transport (a call ordered on the GPU would hear the executor's refusal only
// at its next call); the client goes on serving good calls.
TEST_F(SameHostTest, ACallOfTheWrongShapeOrDtypeIsRefusedByTheClientNamingTheLayer) {
  for (const std::string transport : {"shm", "tcp"}) {
    SCOPED_TRACE(transport);
    auto client = connect(transport);
    const auto& q = *client->find_layer("model.layers.0.self_attn.q_proj");
    auto message_of = [&](const std::function<void()>& call) -> std::string {
      try {
        call();
      } catch (const c10::Error& e) {
        return e.what_without_backtrace();
      }
      return "";
    };
    const auto calls = client->calls();
    EXPECT_NE(message_of([&] {
                client->forward(q, at::randn({2, 5}), true);
              })
                  .find("layer 'model.layers.0.self_attn.q_proj' (forward) takes [tokens, 4] in Float, got [2, 5] in "
                        "Float"),
              std::string::npos);
    EXPECT_NE(message_of([&] {
                client->backward_input(q, at::randn({2, 4}));
              }).find("(backward) takes [tokens, 8] in Float, got [2, 4]"),
              std::string::npos);
    EXPECT_NE(message_of([&] {
                client->forward(q, at::randn({2, 4}, at::kDouble), true);
              }).find("takes [tokens, 4] in Float, got [2, 4] in Double"),
              std::string::npos);
    EXPECT_NE(message_of([&] { client->forward(q, at::randn({4}), true); }).find("got [4] in Float"),
              std::string::npos);
    EXPECT_EQ(client->calls(), calls) << "a refused call reached the executor";
    const auto x = at::randn({2, 4});
    EXPECT_TRUE(at::allclose(client->forward(q, x, true), at::mm(x, q_weight().t()), 1e-6, 1e-6));
    // An input whose rows do not lie one after another (a transposed view) is taken as it reads.
    const auto strided = at::randn({4, 3}).t();
    ASSERT_FALSE(strided.is_contiguous());
    EXPECT_TRUE(at::allclose(client->forward(q, strided, true), at::mm(strided, q_weight().t()), 1e-6, 1e-6));
  }
}

// Control "zmq": the payload stays in shared memory, the headers go over ZeroMQ (as an nccl client's
// do from another host); the executor checks them as it checks the ring's.
TEST_F(SameHostTest, HeadersOverZeroMQAreCheckedAndAnsweredLikeTheRings) {
  auto client = connect("shm", "zmq");
  EXPECT_EQ(client->transport(), "shm");
  const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
  for (int64_t tokens : {int64_t{1}, int64_t{300}, int64_t{1} << 20}) {  // the last one grows the buffer
    auto x = at::randn({tokens, 4});
    EXPECT_TRUE(at::allclose(client->forward(*up, x, true), at::addmm(up_bias(), x, up_weight().t()), 1e-5, 1e-5));
  }

  RawShmPeer peer(executor_->endpoint(), "zmq");
  auto x = at::randn({1, 4});
  std::memcpy(peer.payload.data(), x.data_ptr(), 16);
  ASSERT_EQ(peer.zmq_error_of([](proto::Request&) {}), "");
  auto y = at::from_blob(static_cast<char*>(peer.payload.data()) + 256, {1, 8});
  EXPECT_TRUE(at::allclose(y, at::mm(x, q_weight().t()), 1e-6, 1e-6));
  auto contains = [](const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; };
  EXPECT_TRUE(contains(peer.zmq_error_of([](auto& r) { r.set_layer_id(9); }), "unknown layer id 9"));
  EXPECT_TRUE(
      contains(peer.zmq_error_of([](auto& r) { r.set_shape(1, 5); }), "shape [1, 5] should be [tokens >= 1, 4]"));
  EXPECT_TRUE(contains(peer.zmq_error_of([](auto& r) { r.set_out_offset(4090); }), "lies outside the 4096-byte"));
  EXPECT_TRUE(contains(peer.zmq_error_of([](proto::Request&) {}, /*with_frame=*/true),
                       "a shm client's request carries no payload frame"));
  EXPECT_EQ(peer.zmq_error_of([](proto::Request&) {}), "");

  // A client of the shared-memory control channel cannot switch to ZeroMQ headers.
  RawShmPeer ring_peer(executor_->endpoint());
  EXPECT_TRUE(contains(ring_peer.zmq_error_of([](proto::Request&) {}), "go through its shared-memory control channel"));
  EXPECT_EQ(ring_peer.error_of([](shm::CallHeader&) {}), "");
}

TEST_F(SameHostTest, ACorruptRingDropsOnlyThatClient) {
  auto good = connect("shm");
  {
    RawShmPeer peer(executor_->endpoint());
    reinterpret_cast<std::atomic<uint64_t>*>(&peer.block->requests)->store(1000);  // head far past capacity
    shm::wake_executor(*peer.block, peer.wake.get());
    EXPECT_TRUE(testing::same_host_clients_become(*executor_, 1))
        << "the executor kept the client that corrupted its ring";
  }
  const auto* q = good->find_layer("model.layers.0.self_attn.q_proj");
  auto x = at::randn({3, 4});
  EXPECT_TRUE(at::allclose(good->forward(*q, x, true), at::mm(x, q_weight().t()), 1e-6, 1e-6));
}

TEST_F(SameHostTest, ClientsKilledMidRequestAreForgottenAndReleased) {
  const std::string endpoint = executor_->endpoint();
  for (int i = 0; i < 3; ++i) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Fresh ZeroMQ and shared-memory objects only (nothing of the parent's threads): a call
      // answered, then one more pushed, and death before its answer.
      RawShmPeer peer(endpoint);
      peer.call([](shm::CallHeader&) {});
      shm::CallRecord r;
      r.header = {.request_id = 99,
                  .layer_id = 1,
                  .op = proto::FORWARD,
                  .dtype = proto::FLOAT32,
                  .latency_class = proto::FINE_TUNING,
                  .tokens = 40,
                  .features = 4,
                  .in_offset = 0,
                  .out_offset = 1024,
                  .buffer_generation = 1};
      peer.block->requests.push(r);
      shm::wake_executor(*peer.block, peer.wake.get());
      ::raise(SIGKILL);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status));
  }
  EXPECT_TRUE(testing::same_host_clients_become(*executor_, 0)) << "the executor still holds a dead client's channel";
  EXPECT_EQ(executor_->stats().clients, 0u);
  EXPECT_EQ(executor_->stats().errors, 0u);
  auto survivor = connect("shm");
  auto x = at::randn({2, 4});
  EXPECT_TRUE(at::allclose(survivor->forward(*survivor->find_layer("model.layers.0.self_attn.q_proj"), x, true),
                           at::mm(x, q_weight().t()), 1e-6, 1e-6));
}

// The probe's first finding: a peer that copied the executor's host into its Hello was given shared
// memory. Now a same-host transport waits for a proof only a process of this host, the one the
// Hello names, can give ([Proven placement] in transport/local_socket.h).
TEST_F(SameHostTest, APeerThatClaimsTheExecutorsHostWithoutProvingItGetsNoSharedMemory) {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::dealer};
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::rcvtimeo, 10000);
  socket.connect(executor_->endpoint());
  // The claim alone gets a challenge, not a Welcome.
  auto answer = testing::exchange(socket, shm_hello(::getpid()));
  ASSERT_TRUE(answer.has_prove_host()) << answer.DebugString();
  // A peer elsewhere cannot reach the local socket; set-up over ZeroMQ is refused, and so are calls.
  proto::Envelope registration;
  registration.mutable_register_buffer()->set_generation(1);
  registration.mutable_register_buffer()->set_bytes(4096);
  answer = testing::exchange(socket, registration);
  ASSERT_TRUE(answer.has_error());
  EXPECT_NE(answer.error().message().find("payload set-up over ZeroMQ"), std::string::npos) << answer.error().message();
  proto::Envelope request;
  request.mutable_request()->set_request_id(1);
  answer = testing::exchange(socket, request);
  ASSERT_TRUE(answer.has_reply());
  EXPECT_NE(answer.reply().error().message().find("before the handshake"), std::string::npos);
  // A process of this host that names another process in its Hello is refused, and told why.
  const pid_t other = ::getppid();
  answer = testing::exchange(socket, shm_hello(other));
  ASSERT_TRUE(answer.has_prove_host());
  auto proof = local::prove(answer.prove_host(), 10000);
  ASSERT_FALSE(proof.is_ok());
  const std::string why = "the Hello named process " + std::to_string(other) + ", but process " +
                          std::to_string(::getpid()) + " came to prove it";
  EXPECT_NE(proof.status().message().find("same-host placement not proven: " + why), std::string::npos)
      << proof.status().message();
  EXPECT_EQ(proof.status().code(), StatusCode::kPermissionDenied);
  // No Welcome came: its calls are still refused.
  answer = testing::exchange(socket, request);
  ASSERT_TRUE(answer.has_reply());
  EXPECT_NE(answer.reply().error().message().find("before the handshake"), std::string::npos);
  // A token is good once.
  answer = testing::exchange(socket, shm_hello(::getpid()));
  ASSERT_TRUE(answer.has_prove_host());
  const auto challenge = answer.prove_host();
  ASSERT_TRUE(local::prove(challenge, 10000).is_ok());
  auto frames = wire::recv_all(socket);
  ASSERT_TRUE(wire::parse(frames.at(0), &answer));
  EXPECT_TRUE(answer.has_welcome());
  auto again = local::prove(challenge, 10000);
  ASSERT_FALSE(again.is_ok());
  EXPECT_NE(again.status().message().find("unknown or expired proof token"), std::string::npos)
      << again.status().message();
}

// The probe's second finding: a process watching /dev/shm registered an honest client's payload
// segment before the client did, and the client's training diverged. Now no segment has a name,
// and whatever another process sends about a client it is not is refused: the honest client
// (another process, fine-tuning over shm with --verify) stays exact.
TEST_F(SameHostTest, AProcessRacingForAnHonestClientsSegmentsGetsNothingAndTheClientStaysExact) {
  const auto model = testing::make_checkpoint("tiny-llama");
  auto executor = testing::start_executor(model);
  auto shm_names = [] {
    std::set<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) names.insert(entry.path());
    return names;
  };
  const auto before = shm_names();
  const pid_t honest =
      testing::spawn({testing::binary("examples/symbiosis-demo-client"), "--executor", executor->endpoint(), "--model",
                      model.string(), "--transport", "shm", "--steps", "4", "--verify", "--quiet"});
  std::set<std::string> named;  // what appeared in /dev/shm while the client ran
  int attempts = 0, status = 0;
  while (::waitpid(honest, &status, WNOHANG) == 0) {
    for (const auto& name : shm_names()) {
      if (!before.count(name)) named.insert(name);
    }
    // Claims the honest client's process, and proves from this one.
    zmq::context_t context{1};
    zmq::socket_t socket{context, zmq::socket_type::dealer};
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::rcvtimeo, 10000);
    socket.connect(executor->endpoint());
    const auto challenge = testing::exchange(socket, shm_hello(honest));
    ASSERT_TRUE(challenge.has_prove_host());
    EXPECT_FALSE(local::prove(challenge.prove_host(), 10000).is_ok());
    attempts++;
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the honest client's split run left its monolithic run";
  EXPECT_GT(attempts, 0);
  EXPECT_TRUE(named.empty()) << "a segment had a name in /dev/shm: " << *named.begin();
}

// Issue 44's first finding: a proven tenant shrank a segment the executor had mapped (its payload
// buffer, its control segment, or the doorbell every same-host client shared) and the executor
// died of SIGBUS. Now every segment is sealed ([Sealed segments] in transport/shared_memory.h), an
// unsealed one is refused naming the seal, and each client wakes the executor through a pipe of its
// own ([Wake sockets] in transport/call_ring.h), which it may flood, close or lie about to no one's
// cost but its own: honest tenants over shm and tcp (other processes, fine-tuning with --verify
// against their monolithic runs) finish exact during and after the attacks.
TEST_F(SameHostTest, NoTenantCanShrinkWhatTheExecutorMapsOrKeepItAsleepAndHonestTenantsStayExact) {
  const auto model = testing::make_checkpoint("tiny-llama");
  executor_ = testing::start_executor(model);
  auto honest = [&](const std::string& transport) {
    return testing::spawn({testing::binary("examples/symbiosis-demo-client"), "--executor", executor_->endpoint(),
                           "--model", model.string(), "--transport", transport, "--steps", "6", "--verify", "--quiet"});
  };
  const pid_t during_shm = honest("shm"), during_tcp = honest("tcp");
  {
    RawShmPeer attacker(executor_->endpoint());
    EXPECT_NE(::ftruncate(attacker.control.descriptor(), 0), 0) << "the control segment shrank";
    EXPECT_EQ(errno, EPERM);
    EXPECT_NE(::ftruncate(attacker.payload.descriptor(), 0), 0) << "the registered payload buffer shrank";
    EXPECT_EQ(errno, EPERM);
    EXPECT_NE(::ftruncate(attacker.wake.get(), 0), 0) << "the wake socket is not a pipe";
    // An unsealed buffer is refused, naming the seal; the one registered before stays.
    UniqueFd unsealed(::memfd_create("unsealed", MFD_CLOEXEC));
    ASSERT_EQ(::ftruncate(unsealed.get(), 4096), 0);
    proto::Envelope registration;
    registration.mutable_register_buffer()->set_generation(2);
    registration.mutable_register_buffer()->set_bytes(4096);
    const auto refused = testing::setup_exchange(attacker.socket, attacker.link.get(), registration, unsealed.get());
    ASSERT_TRUE(refused.has_error()) << refused.DebugString();
    EXPECT_NE(refused.error().message().find("not sealed against shrinking"), std::string::npos)
        << refused.error().message();
    EXPECT_NE(refused.error().message().find("F_SEAL_SHRINK"), std::string::npos) << refused.error().message();
    // Flooding its own pipe and clearing the flag that says the executor sleeps, while honest
    // tenants train.
    for (int round = 0; round < 2000; ++round) {
      for (int i = 0; i < 100; ++i) shm::wake(attacker.wake.get());
      attacker.block->executor_sleeping.store(0);
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    // Its end of the wake socket closed: the scheduler polls it no more, and serves on.
    attacker.wake.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_TRUE(executor_->stats().clients >= 1);
  }
  EXPECT_TRUE(testing::exited_ok(during_shm)) << "an honest shm tenant left its monolithic run during the attacks";
  EXPECT_TRUE(testing::exited_ok(during_tcp)) << "an honest tcp tenant left its monolithic run during the attacks";
  const pid_t after = honest("shm");
  EXPECT_TRUE(testing::exited_ok(after)) << "an honest tenant left its monolithic run after the attacks";
}

// Issue 44's fifth finding: a process of the executor's user opened its memfds through
// /proc/PID/fd and rewrote a tenant's payload. The executor is now non-dumpable ([Not dumpable] in
// base_executor/main.cpp), so such a process cannot open its descriptors, while it can open those
// of a dumpable process of the same user (which shows the test can fail). Run as root, every
// process here goes without CAP_SYS_PTRACE, the one power by which root alone passes that check
// (and the attacker holds no capability its targets lack, which the kernel also asks).
TEST_F(SameHostTest, AProcessOfTheExecutorsUserCannotOpenItsDescriptors) {
  const auto model = testing::make_checkpoint("tiny-llama");
  const auto log = testing::temp_dir("not-dumpable") / "executor.out";
  const std::string without_ptrace = ::geteuid() == 0 ? "setpriv --bounding-set=-sys_ptrace " : "";
  const pid_t executor =
      testing::spawn({"/bin/sh", "-c",
                      "exec " + without_ptrace + testing::binary("base_executor/symbiosis-executor") + " --model " +
                          model.string() + " --listen 'tcp://127.0.0.1:*' --device cpu > " + log.string() + " 2>&1"});
  const pid_t dumpable = testing::spawn({"/bin/sh", "-c", "exec " + without_ptrace + "sleep 60"});
  const bool ready = !bench::wait_ready(executor, log, 1, 60'000).empty();
  // Whether a process of this user, without CAP_SYS_PTRACE, reaches a descriptor of process `pid`.
  auto can_open = [&](pid_t pid) {
    const pid_t child = ::fork();
    if (child == 0) {
      __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
      __user_cap_data_struct caps[2] = {};
      if (::syscall(SYS_capget, &header, caps) != 0) ::_exit(2);
      caps[0].effective &= ~(1u << CAP_SYS_PTRACE);
      caps[0].permitted &= ~(1u << CAP_SYS_PTRACE);
      if (::syscall(SYS_capset, &header, caps) != 0) ::_exit(2);
      // Where the descriptor leads: the kernel's same check as for opening it, whatever it is.
      const std::string fd = "/proc/" + std::to_string(pid) + "/fd/0";
      char target[256];
      ::_exit(::readlink(fd.c_str(), target, sizeof target) >= 0 ? 1 : 0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const int executor_open = can_open(executor), dumpable_open = can_open(dumpable);
  ::kill(executor, SIGTERM);
  ::kill(dumpable, SIGKILL);
  testing::exited_ok(executor);
  testing::exited_ok(dumpable);
  ASSERT_TRUE(ready) << "the executor did not start";
  EXPECT_EQ(executor_open, 0) << "a process of the executor's user opened its descriptors";
  EXPECT_EQ(dumpable_open, 1) << "the same process could not open a dumpable one's either: the test proves nothing";
}

// A client that cannot prove it runs where it says (here, in a PID namespace of its own, as in a
// container: the executor sees another pid than the one it names) and asked for "auto" falls back
// to TCP, saying why, and stays exact.
TEST_F(SameHostTest, AClientThatCannotProveItsPlacementFallsBackToTcpAndStaysExact) {
  if (testing::shell("unshare --pid --fork true > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "this machine cannot make a PID namespace (unshare --pid), which the test needs";
  }
  const auto model = testing::make_checkpoint("tiny-llama");
  auto executor = testing::start_executor(model);
  const auto log = testing::temp_dir("fallback") / "client.log";
  const int status = testing::shell("unshare --pid --fork " + testing::binary("examples/symbiosis-demo-client") +
                                    " --executor " + executor->endpoint() + " --model " + model.string() +
                                    " --transport auto --steps 2 --verify --quiet > " + log.string() + " 2>&1");
  std::ifstream in(log);
  const std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("no same-host transport, using tcp"), std::string::npos) << output;
  EXPECT_NE(output.find("came to prove it"), std::string::npos) << output;
  EXPECT_NE(output.find("verify (tcp)"), std::string::npos) << output;
}

// Handshakes that never prove are held for a while, and only so many: a flood of them is refused
// without the executor holding state without end, and an honest client still connects.
TEST_F(SameHostTest, UnprovenHandshakesAreBoundedAndAnHonestClientStillConnects) {
  zmq::context_t context{1};
  std::vector<std::unique_ptr<zmq::socket_t>> peers;
  const auto hello = shm_hello(::getpid());
  int challenged = 0;
  std::string refusal;
  for (int i = 0; i < 300 && refusal.empty(); ++i) {
    auto& socket = *peers.emplace_back(std::make_unique<zmq::socket_t>(context, zmq::socket_type::dealer));
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::rcvtimeo, 10000);
    socket.connect(executor_->endpoint());
    const auto answer = testing::exchange(socket, hello);
    if (answer.has_prove_host()) challenged++;
    if (answer.has_error()) refusal = answer.error().message();
  }
  EXPECT_EQ(challenged, 256);
  EXPECT_NE(refusal.find("too many placement proofs pending"), std::string::npos) << refusal;
  auto client = connect("tcp");
  auto x = at::randn({2, 4});
  EXPECT_TRUE(at::allclose(client->forward(*client->find_layer("model.layers.0.self_attn.q_proj"), x, true),
                           at::mm(x, q_weight().t()), 1e-6, 1e-6));
}

}  // namespace
}  // namespace symbiosis
