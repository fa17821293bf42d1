// The executor's contract: the layer table, exact base computations, a precise error for every
// bad request, and service that survives bad and dying clients.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "base_executor/executor.h"
#include "client_runtime/client.h"
#include "common/checkpoint.h"
#include "tests/test_util.h"
#include "transport/call_ring.h"
#include "transport/client_transport.h"
#include "transport/local_socket.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using testing::relative_error;

// A small Llama-named checkpoint written by hand: two base layers, plus tensors that are not.
class ExecutorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    checkpoint_ = new testing::TwoLayerCheckpoint(testing::write_two_layer_checkpoint("executor-test", 1, true));
  }

  void SetUp() override {
    ExecutorOptions options;
    options.max_request_bytes = 4096;
    executor_ = testing::start_executor(checkpoint_->dir, options);
  }

  std::shared_ptr<Client> connect() {
    ClientOptions options;
    options.endpoint = executor_->endpoint();
    options.timeout_ms = 10000;
    return Client::connect(options);
  }

  // A raw DEALER that has done the handshake, for sending what a real client never would.
  struct RawPeer {
    zmq::context_t context{1};
    zmq::socket_t socket{context, zmq::socket_type::dealer};
    // `receive_queue`: replies its socket takes in before it stops reading from TCP (ZMQ_RCVHWM).
    explicit RawPeer(const std::string& endpoint, bool handshake = true, int receive_queue = 1000) {
      socket.set(zmq::sockopt::linger, 0);
      socket.set(zmq::sockopt::rcvtimeo, 10000);
      socket.set(zmq::sockopt::rcvhwm, receive_queue);
      if (receive_queue < 1000) socket.set(zmq::sockopt::rcvbuf, 1 << 16);
      socket.connect(endpoint);
      if (!handshake) return;
      proto::Envelope hello;
      hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
      socket.send(wire::serialize(hello), zmq::send_flags::none);
      EXPECT_TRUE(receive().has_welcome());
    }
    proto::Envelope receive() {
      auto frames = wire::recv_all(socket);
      proto::Envelope env;
      EXPECT_FALSE(frames.empty());
      EXPECT_TRUE(wire::parse(frames[0], &env));
      return env;
    }
    // Sends a request header and the given payload frames; returns the error message.
    std::string request_error(uint32_t layer, proto::Op op, proto::DType dtype, std::vector<int64_t> shape,
                              std::vector<size_t> payload_bytes) {
      proto::Envelope env;
      auto* r = env.mutable_request();
      r->set_request_id(77);
      r->set_layer_id(layer);
      r->set_op(op);
      r->set_dtype(dtype);
      for (auto d : shape) r->add_shape(d);
      socket.send(wire::serialize(env), payload_bytes.empty() ? zmq::send_flags::none : zmq::send_flags::sndmore);
      for (size_t i = 0; i < payload_bytes.size(); ++i) {
        socket.send(zmq::message_t(payload_bytes[i]),
                    i + 1 < payload_bytes.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
      auto reply = receive();
      EXPECT_TRUE(reply.has_reply());
      EXPECT_EQ(reply.reply().request_id(), 77u);
      EXPECT_NE(reply.reply().error().code(), proto::OK);
      return reply.reply().error().message();
    }
  };

  void expect_still_serving() {
    auto client = connect();
    auto x = at::randn({3, 4});
    auto y = client->forward(*client->find_layer("model.layers.0.mlp.up_proj"), x, true);
    EXPECT_LT(relative_error(y, at::addmm(up_bias(), x, up_weight().t())), 1e-6);
  }

  static const at::Tensor& q_weight() { return checkpoint_->q; }
  static const at::Tensor& up_weight() { return checkpoint_->up_weight; }
  static const at::Tensor& up_bias() { return checkpoint_->up_bias; }
  static testing::TwoLayerCheckpoint* checkpoint_;
  std::unique_ptr<Executor> executor_;
};

testing::TwoLayerCheckpoint* ExecutorTest::checkpoint_ = nullptr;

TEST(ExecutorOptionsTest, ComputeStreamOptionsOutOfRangeAreRefusedNamingTheFlag) {
  auto refused = [](ExecutorOptions options, const std::string& flag) {
    try {
      options.validate();
      ADD_FAILURE() << "options with a bad " << flag << " were accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(flag), std::string::npos) << e.what_without_backtrace();
    }
  };
  refused({.model_dir = "model", .streams = 0}, "--streams");
  refused({.model_dir = "model", .streams = 33}, "--streams");
  refused({.model_dir = "model", .concurrent_tokens = -1}, "--concurrent-tokens");
  refused({.model_dir = "model", .finetune_sm_percent = 0}, "--finetune-sm-percent must be 1 to 100, got 0");
  refused({.model_dir = "model", .finetune_sm_percent = 101}, "--finetune-sm-percent");
  refused({.model_dir = "model", .finetune_piece_rows = -1}, "--finetune-piece-rows must be 0 or more, got -1");
  EXPECT_NO_THROW(ExecutorOptions({.model_dir = "model", .streams = 1, .concurrent_tokens = 0}).validate());
}

// An architecture outside the supported ones is refused under the default base-layer rule, naming
// its model_type and the supported list as the client's open_causal_lm does; named by
// --layer-pattern, its layers are served.
TEST(ExecutorOptionsTest, OverloadLimitsOutOfRangeAreRefusedNamingTheFlag) {
  ExecutorOptions options;
  options.model_dir = "/nonexistent";
  options.validate();
  auto refusal = [&](auto change) {
    ExecutorOptions changed = options;
    change(changed);
    try {
      changed.validate();
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal([](ExecutorOptions& o) { o.max_clients = 0; }).find("--max-clients must be >= 1"),
            std::string::npos);
  EXPECT_NE(refusal([](ExecutorOptions& o) { o.max_queued_messages = 0; }).find("--max-queued-messages must be >= 1"),
            std::string::npos);
  EXPECT_NE(refusal([](ExecutorOptions& o) { o.max_message_bytes = 1024; }).find("must be at least a payload frame"),
            std::string::npos);
  EXPECT_EQ(options.message_limit(), wire::kPayloadFrameBytes + (size_t{64} << 10));
  EXPECT_NE(
      refusal([](ExecutorOptions& o) { o.max_queued_tokens = 0; }).find("--max-queued-tokens must be >= 1, got 0"),
      std::string::npos);
  EXPECT_NE(refusal([](ExecutorOptions& o) { o.max_buffer_bytes = 0; }).find("--max-buffer-bytes must be >= 1, got 0"),
            std::string::npos);
  // [Metrics]: HOST:PORT, on loopback unless --insecure.
  EXPECT_EQ(refusal([](ExecutorOptions& o) { o.metrics_listen = "127.0.0.1:0"; }), "accepted");
  EXPECT_EQ(refusal([](ExecutorOptions& o) { o.metrics_listen = "[::1]:9100"; }), "accepted");
  const auto no_port = refusal([](ExecutorOptions& o) { o.metrics_listen = "127.0.0.1"; });
  EXPECT_NE(no_port.find("--metrics-listen '127.0.0.1' names no host and port (expected HOST:PORT"), std::string::npos)
      << no_port;
  const auto bad_port = refusal([](ExecutorOptions& o) { o.metrics_listen = "localhost:99999"; });
  EXPECT_NE(bad_port.find("port '99999' is not a number from 0 to 65535"), std::string::npos) << bad_port;
  const auto scheme = refusal([](ExecutorOptions& o) { o.metrics_listen = "http://127.0.0.1:9100"; });
  EXPECT_NE(scheme.find("without a scheme or path"), std::string::npos) << scheme;
  const auto open = refusal([](ExecutorOptions& o) { o.metrics_listen = "0.0.0.0:9100"; });
  EXPECT_NE(open.find("--metrics-listen 0.0.0.0:9100 is reachable from other hosts"), std::string::npos) << open;
  EXPECT_NE(open.find("--insecure"), std::string::npos) << open;
  EXPECT_EQ(refusal([](ExecutorOptions& o) {
              o.metrics_listen = "0.0.0.0:9100";
              o.insecure = true;
            }),
            "accepted");
}

// [Any architecture] (base_model.cpp): a model_type the C++ client runtime has no model for is
// served by the default rule, its 2-D weights as Linear layers; a checkpoint none of whose names
// the rule matches is refused, naming its model_type, the pattern and --layer-pattern.
TEST(BaseModelTest, AnyModelTypeIsServedAndACheckpointWithoutMatchingLayersIsRefused) {
  const auto dir = testing::temp_dir("other-model-type");
  write_safetensors(dir / "model.safetensors", {{"model.layers.0.self_attn.qkv_proj.weight", at::randn({12, 4})},
                                                {"model.layers.0.input_layernorm.weight", at::randn({4})}});
  std::ofstream(dir / "config.json") << R"({"model_type": "phi3"})";
  auto executor = testing::start_executor(dir);
  ASSERT_EQ(executor->model().layers().size(), 1u);
  const auto& layer = executor->model().layers()[0];
  EXPECT_EQ(layer.name, "model.layers.0.self_attn.qkv_proj");
  EXPECT_EQ(layer.kind, LayerKind::kLinear);
  EXPECT_EQ(layer.in_features, 4);
  EXPECT_EQ(layer.out_features, 12);

  const auto other = testing::temp_dir("unmatched-layers");
  write_safetensors(other / "model.safetensors", {{"backbone.blocks.0.mixer.in_proj.weight", at::randn({8, 4})}});
  std::ofstream(other / "config.json") << R"({"model_type": "mamba"})";
  const auto message = testing::error_of([&] { testing::start_executor(other); });
  for (const char* part : {"model_type 'mamba'", "has no base layers matching", "--layer-pattern"}) {
    EXPECT_NE(message.find(part), std::string::npos) << message;
  }
  ExecutorOptions named;
  named.layers.pattern = R"(^backbone\.blocks\.[0-9]+\..+$)";
  EXPECT_EQ(testing::start_executor(other, named)->model().layers().size(), 1u);
}

// [Inference first]: statistics show the latency classes apart, as each client set its own.
TEST_F(ExecutorTest, StatisticsShowTheLatencyClassesApart) {
  auto decoder = connect();
  decoder->set_latency_class(LatencyClass::kInferenceDecode);
  auto trainer = connect();
  const auto* q = decoder->find_layer("model.layers.0.self_attn.q_proj");
  for (int i = 0; i < 3; ++i) decoder->forward(*q, at::randn({1, 4}), true);
  trainer->forward(*trainer->find_layer("model.layers.0.self_attn.q_proj"), at::randn({5, 4}), true);
  std::map<proto::LatencyClass, std::pair<uint64_t, uint64_t>> seen;  // requests, tokens
  // A batch is counted just after its replies went out.
  testing::wait_until(
      [&] {
        seen.clear();
        const auto stats = request_stats(executor_->endpoint(), 10000);
        for (const auto& c : stats.classes()) {
          seen[c.latency_class()] = {c.requests(), c.tokens()};
        }
        return seen[proto::FINE_TUNING].first == 1;
      },
      std::chrono::seconds(5));
  EXPECT_EQ(seen[proto::INFERENCE_DECODE], std::make_pair(uint64_t{3}, uint64_t{3}));
  EXPECT_EQ(seen[proto::FINE_TUNING], std::make_pair(uint64_t{1}, uint64_t{5}));
  EXPECT_EQ(seen.count(proto::INFERENCE_PREFILL), 0u);
}

// [Traces] (base_executor/tracing.h): an operator's trace names each batch's calls by client and
// request, as the client's own trace names them; a mistaken request is refused naming the problem.
TEST_F(ExecutorTest, ATraceNamesEachBatchsCallsAndMistakesAreRefusedClearly) {
  const auto dir = testing::temp_dir("executor-trace");
  const auto path = (dir / "executor.trace.json").string();
  const auto endpoint = executor_->endpoint();
  const auto refused = [&](bool start, const std::string& where, const std::string& why) {
    const auto message = testing::error_of([&] { request_trace(endpoint, 10000, start, where); });
    EXPECT_NE(message.find(why), std::string::npos) << message;
  };
  refused(false, "", "no trace is running");
  refused(true, (dir / "no/such/dir/t.json").string(), "cannot write the trace file");
  EXPECT_EQ(request_trace(endpoint, 10000, true, path).path(), path);
  refused(true, path, "a trace is running already");
  auto client = connect();
  const auto* q = client->find_layer("model.layers.0.self_attn.q_proj");
  for (int i = 0; i < 3; ++i) client->forward(*q, at::randn({2, 4}), true);
  const auto written = request_trace(endpoint, 10000, false);
  EXPECT_EQ(written.path(), path);
  EXPECT_EQ(written.batches(), 3u);
  std::ifstream file(path);
  const auto trace = nlohmann::json::parse(file);
  std::set<std::string> batches;
  for (const auto& event : trace.at("traceEvents")) {
    const std::string name = event.value("name", "");
    if (name.rfind("symbiosis::batch ", 0) == 0) batches.insert(name);
  }
  std::set<std::string> expected;
  for (int request = 1; request <= 3; ++request) {
    expected.insert("symbiosis::batch model.layers.0.self_attn.q_proj forward 2t c" +
                    std::to_string(client->client_id()) + ":r" + std::to_string(request));
  }
  EXPECT_EQ(batches, expected);
  EXPECT_EQ(executor_->stats().errors, 0u);  // an operator's mistakes are not the tenants' errors
}

TEST_F(ExecutorTest, HandshakeReturnsOnlyTheBaseLayers) {
  auto client = connect();
  const auto& layers = client->layers();
  ASSERT_EQ(layers.size(), 2u);  // no embeddings, norms or lm_head by default
  const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->in_features, 4);
  EXPECT_EQ(up->out_features, 6);
  EXPECT_TRUE(up->bias);
  EXPECT_EQ(up->kind, LayerKind::kLinear);
  const auto* q = client->find_layer("model.layers.0.self_attn.q_proj");
  ASSERT_NE(q, nullptr);
  EXPECT_FALSE(q->bias);
  EXPECT_EQ(client->model_hash(), Checkpoint::open(checkpoint_->dir)->model_hash());
}

TEST_F(ExecutorTest, LmHeadIsABaseLayerOnlyWhenAsked) {
  ExecutorOptions options;
  options.layers.lm_head = true;
  auto executor = testing::start_executor(checkpoint_->dir, options);
  ASSERT_EQ(executor->model().layers().size(), 3u);
}

TEST_F(ExecutorTest, ComputesForwardBackwardAndNoBiasExactly) {
  auto client = connect();
  const auto& up = *client->find_layer("model.layers.0.mlp.up_proj");
  auto x = at::randn({5, 4});
  auto g = at::randn({5, 6});
  EXPECT_LT(relative_error(client->forward(up, x, true), at::addmm(up_bias(), x, up_weight().t())), 1e-6);
  EXPECT_LT(relative_error(client->forward(up, x, false), at::mm(x, up_weight().t())), 1e-6);
  EXPECT_LT(relative_error(client->backward_input(up, g), at::mm(g, up_weight())), 1e-6);
}

// [Bounded frames] (transport/zmq_wire.h): a tcp call's payload and its result larger than one
// frame travel in several, each within the executor's frame limit, and compute as one.
TEST_F(ExecutorTest, APayloadLargerThanAFrameTravelsInBoundedFramesAndComputesAsOne) {
  ExecutorOptions options;
  executor_ = testing::start_executor(checkpoint_->dir, options);
  auto client = connect();
  const auto& up = *client->find_layer("model.layers.0.mlp.up_proj");
  auto x = at::randn({100000, 4});  // 1.6 MB in, 2.4 MB out: two and three frames
  ASSERT_GT(x.nbytes(), options.message_limit());
  EXPECT_LT(relative_error(client->forward(up, x, true), at::addmm(up_bias(), x, up_weight().t())), 1e-6);
  auto g = at::randn({100000, 6});
  EXPECT_LT(relative_error(client->backward_input(up, g), at::mm(g, up_weight())), 1e-6);
}

// [Input observer]: the hook sees every call's input as the client sent it (its client, layer, op
// and rows), over tcp and shm alike, by the time the call is answered; calls that came one after
// another ran as batches numbered one after another.
TEST_F(ExecutorTest, InputObserverSeesEachCallsInputAsTheClientSentIt) {
  struct Seen {
    uint64_t batch;
    uint64_t client_id;
    uint32_t layer_id;
    LayerOp op;
    at::Tensor input;
  };
  std::mutex mutex;
  std::vector<Seen> seen;  // guarded by mutex
  ExecutorOptions options;
  options.on_input = [&](uint64_t batch, uint64_t client_id, const LayerInfo& layer, LayerOp op,
                         const at::Tensor& input) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.push_back({batch, client_id, layer.id, op, input.clone()});
  };
  auto executor = testing::start_executor(checkpoint_->dir, options);
  for (const std::string transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    auto client = testing::connect(*executor, ClientOptions{.timeout_ms = 10000, .transport = transport});
    ASSERT_EQ(client->transport(), transport);
    const auto& up = *client->find_layer("model.layers.0.mlp.up_proj");
    const std::vector<std::pair<LayerOp, at::Tensor>> sent = {{LayerOp::kForward, at::randn({3, 4})},
                                                              {LayerOp::kBackwardInput, at::randn({2, 6})},
                                                              {LayerOp::kForwardNoBias, at::randn({1, 4})}};
    client->forward(up, sent[0].second, true);
    client->backward_input(up, sent[1].second);
    client->forward(up, sent[2].second, false);
    std::lock_guard<std::mutex> lock(mutex);
    ASSERT_EQ(seen.size(), sent.size());
    for (size_t i = 0; i < sent.size(); ++i) {
      EXPECT_EQ(seen[i].client_id, client->client_id()) << "call " << i;
      EXPECT_EQ(seen[i].layer_id, up.id) << "call " << i;
      EXPECT_EQ(seen[i].op, sent[i].first) << "call " << i;
      EXPECT_TRUE(at::equal(seen[i].input, sent[i].second)) << "call " << i;
      // One call after another: each its own batch, numbered in order.
      if (i > 0) EXPECT_EQ(seen[i].batch, seen[i - 1].batch + 1) << "call " << i;
    }
    seen.clear();
  }
}

// [Layer groups]: under each parent module, layers that read one input are also served as one
// layer whose weight is theirs stacked: its forward is theirs side by side (biases too), its
// backward the sum of theirs, and the weights take no more memory than the layers alone. Layers of
// different input widths are not grouped.
TEST(LayerGroupsTest, SiblingsAreServedStackedAsOneLayerWithoutMoreMemory) {
  const auto dir = testing::temp_dir("layer-groups");
  at::manual_seed(2);
  const std::map<std::string, at::Tensor> w = {{"model.layers.0.self_attn.q_proj.weight", at::randn({8, 4})},
                                               {"model.layers.0.self_attn.k_proj.weight", at::randn({2, 4})},
                                               {"model.layers.0.self_attn.v_proj.weight", at::randn({2, 4})},
                                               {"model.layers.0.mlp.gate_proj.weight", at::randn({6, 4})},
                                               {"model.layers.0.mlp.gate_proj.bias", at::randn({6})},
                                               {"model.layers.0.mlp.up_proj.weight", at::randn({6, 4})},
                                               {"model.layers.0.mlp.up_proj.bias", at::randn({6})},
                                               {"model.layers.0.mlp.down_proj.weight", at::randn({4, 6})},
                                               {"model.layers.1.self_attn.q_proj.weight", at::randn({8, 4})},
                                               {"model.layers.1.self_attn.k_proj.weight", at::randn({2, 3})},
                                               {"model.layers.1.self_attn.v_proj.weight", at::randn({2, 4})}};
  write_safetensors(dir / "model.safetensors", {w.begin(), w.end()});
  std::ofstream(dir / "config.json") << R"({"model_type": "llama", "hidden_size": 4})";
  auto executor = testing::start_executor(dir);
  ExecutorOptions without;
  without.layers.groups = {};
  auto plain = testing::start_executor(dir, without);
  EXPECT_TRUE(plain->model().groups().empty());
  EXPECT_EQ(executor->model().weight_bytes(), plain->model().weight_bytes());

  auto client = Client::connect({.endpoint = executor->endpoint()});
  ASSERT_EQ(client->groups().size(), 2u);  // layer 1's k_proj reads 3 features: no group there
  auto layer = [&](const std::string& name) { return client->find_layer("model.layers.0." + name); };
  const struct {
    std::string name;
    std::vector<const LayerInfo*> members;
  } expected[] = {{"model.layers.0.mlp.{gate_proj,up_proj}", {layer("mlp.gate_proj"), layer("mlp.up_proj")}},
                  {"model.layers.0.self_attn.{q_proj,k_proj,v_proj}",
                   {layer("self_attn.q_proj"), layer("self_attn.k_proj"), layer("self_attn.v_proj")}}};
  for (const auto& [name, members] : expected) {
    std::vector<uint32_t> ids;
    for (const auto* member : members) ids.push_back(member->id);
    const auto* group = client->group(ids, "");
    ASSERT_NE(group, nullptr) << name;
    EXPECT_EQ(group->name, name);
    EXPECT_GE(group->id, client->layers().size());
    auto x = at::randn({5, 4});
    std::vector<at::Tensor> forward, no_bias, backward;
    auto g = at::randn({5, group->out_features});
    int64_t column = 0;
    for (const auto* member : members) {
      forward.push_back(client->forward(*member, x, true));
      no_bias.push_back(client->forward(*member, x, false));
      backward.push_back(client->backward_input(*member, g.narrow(1, column, member->out_features).contiguous()));
      column += member->out_features;
    }
    EXPECT_EQ(column, group->out_features);
    EXPECT_LT(relative_error(client->forward(*group, x, true), at::cat(forward, 1)), 1e-6) << name;
    EXPECT_LT(relative_error(client->forward(*group, x, false), at::cat(no_bias, 1)), 1e-6) << name;
    EXPECT_LT(relative_error(client->backward_input(*group, g), at::stack(backward).sum(0)), 1e-5) << name;
  }
  EXPECT_EQ(parse_layer_groups("").size(), 0u);
  try {
    parse_layer_groups("q_proj;gate_proj,up_proj");
    ADD_FAILURE() << "a group of one layer was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("layer group 'q_proj' names 1 layer(s)"), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST_F(ExecutorTest, RefusesAClientBuiltForAnotherModel) {
  ClientOptions options;
  options.endpoint = executor_->endpoint();
  options.expected_model_hash = "0123456789abcdef";
  try {
    Client::connect(options);
    FAIL() << "connect should have thrown";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("but the client's checkpoint is model 0123456789abcdef"), std::string::npos)
        << e.what();
  }
}

// [Weight hash]: a checkpoint of the same config and shapes with other weights (a fine-tuned base)
// is another model; the refusal names both hashes and the model the executor serves.
TEST_F(ExecutorTest, RefusesAClientOfACheckpointWithOtherWeightsNamingBothHashes) {
  const auto tuned = testing::write_two_layer_checkpoint("executor-test-tuned", 2, true);
  const auto served = Checkpoint::open(checkpoint_->dir), other = Checkpoint::open(tuned.dir);
  ASSERT_EQ(served->names(), other->names());
  ASSERT_EQ(served->config_text(), other->config_text());
  ASSERT_NE(served->model_hash(), other->model_hash());
  ClientOptions options;
  options.endpoint = executor_->endpoint();
  options.timeout_ms = 10000;
  options.expected_model_hash = other->model_hash();
  const auto message = testing::error_of([&] { Client::connect(options); });
  EXPECT_NE(message.find("model mismatch: this executor serves model " + served->model_hash() + " ('" +
                         checkpoint_->dir.filename().string() + "'), but the client's checkpoint is model " +
                         other->model_hash()),
            std::string::npos)
      << message;
  options.expected_model_hash = served->model_hash();
  EXPECT_EQ(Client::connect(options)->model_hash(), served->model_hash());
}

// [No silent waits]: a port where nothing listens fails the handshake within seconds, naming the
// endpoint, long before the call timeout; the connect timeout bounds a handshake without answer.
TEST_F(ExecutorTest, UnreachableExecutorIsAClearErrorWithinSeconds) {
  ClientOptions options;
  options.endpoint = "tcp://127.0.0.1:1";  // refuses connections
  ASSERT_EQ(options.timeout_ms, 60000);
  const auto start = std::chrono::steady_clock::now();
  const auto message = testing::error_of([&] { Client::connect(options); });
  EXPECT_NE(message.find("no executor answers at tcp://127.0.0.1:1: connections to it are refused"), std::string::npos)
      << message;
  EXPECT_NE(message.find("is this the right port?"), std::string::npos) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));  // a user-visible bound, not a timing

  options.connect_timeout_ms = 300;
  const auto bounded = testing::error_of([&] { Client::connect(options); });
  EXPECT_NE(bounded.find("executor at tcp://127.0.0.1:1 did not answer the handshake within 300 ms"), std::string::npos)
      << bounded;
}

TEST(ClientOptionsTest, EndpointsWithoutASchemeAreRefusedNamingTheExpectedForm) {
  for (const std::string endpoint : {"127.0.0.1:5555", "localhost:5555"}) {
    ClientOptions options;
    options.endpoint = endpoint;
    const auto message = testing::error_of([&] { Client::connect(options); });
    EXPECT_NE(message.find("client option endpoint '" + endpoint +
                           "' has no scheme: expected tcp://HOST:PORT or ipc://PATH, e.g. tcp://127.0.0.1:5555"),
              std::string::npos)
        << message;
  }
  ClientOptions options;
  options.endpoint = "tcp://localhost";
  EXPECT_NE(testing::error_of([&] {
              options.validate();
            }).find("client option endpoint 'tcp://localhost' names no host and port: expected tcp://HOST:PORT"),
            std::string::npos);
  options.endpoint = "http://localhost:5555";
  EXPECT_NE(testing::error_of([&] { options.validate(); }).find("'http://localhost:5555' is not a ZeroMQ endpoint"),
            std::string::npos);
  options.endpoint = "ipc:///tmp/symbiosis.sock";
  EXPECT_NO_THROW(options.validate());
  options.connect_timeout_ms = 0;
  EXPECT_NE(
      testing::error_of([&] { options.validate(); }).find("client option connect_timeout_ms must be positive, got 0"),
      std::string::npos);
  options.connect_timeout_ms = 1000;
  options.reconnect_ms = -1;  // [Executor restart]
  EXPECT_NE(testing::error_of([&] {
              options.validate();
            }).find("client option reconnect_ms must be >= 0 (0: never reconnect), got -1"),
            std::string::npos);

  ExecutorOptions executor_options;
  executor_options.model_dir = "model";
  executor_options.listen = "127.0.0.1:5555";
  const auto message = testing::error_of([&] { executor_options.validate(); });
  EXPECT_NE(message.find("executor option --listen '127.0.0.1:5555' has no scheme: expected tcp://HOST:PORT or "
                         "ipc://PATH (or inproc://NAME)"),
            std::string::npos)
      << message;
}

// [Shutdown notice]: an executor that stops tells its clients; a tcp client that does not
// reconnect ([Executor restart] in client_runtime/client.cpp) fails its next call at once with
// that, not after its 60 s call timeout, and so does every call after it.
TEST_F(ExecutorTest, AStoppedExecutorFailsItsClientsNextCallsAtOnce) {
  ClientOptions options;
  options.endpoint = executor_->endpoint();
  options.transport = "tcp";
  options.reconnect_ms = 0;
  auto client = Client::connect(options);
  const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
  ASSERT_TRUE(up);
  const auto x = at::randn({3, 4});
  client->forward(*up, x, true);
  executor_->shutdown();
  const auto start = std::chrono::steady_clock::now();
  const std::string expected = "the executor at " + options.endpoint + " shut down";
  for (int call = 0; call < 2; ++call) {
    const auto message = testing::error_of([&] { client->forward(*up, x, true); });
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));  // a user-visible bound, not a timing
}

TEST_F(ExecutorTest, EveryBadRequestGetsAnErrorNamingTheProblem) {
  RawPeer peer(executor_->endpoint());
  const auto F32 = proto::FLOAT32;
  EXPECT_NE(peer.request_error(99, proto::FORWARD, F32, {1, 4}, {16}).find("unknown layer id 99"), std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::FORWARD, F32, {2, 5}, {40}).find("shape [2, 5] should be [tokens >= 1, 4]"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::BACKWARD_INPUT, F32, {2, 4}, {32}).find("should be [tokens >= 1, 8]"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::FORWARD, proto::BFLOAT16, {2, 4}, {16})
                .find("dtype BFLOAT16 does not match the layer's FLOAT32"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::FORWARD, F32, {2000, 4}, {32000}).find("exceed the executor's limit of 4096"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::FORWARD, F32, {2, 4}, {})
                .find("expected the payload in frames after the "
                      "header, got none"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::FORWARD, F32, {2, 4}, {31}).find("payload has 31 bytes, expected 32"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::FORWARD, F32, {2, 4}, {16, 8, 9}).find("payload has 33 bytes, expected 32"),
            std::string::npos);
  EXPECT_NE(peer.request_error(1, proto::OP_UNSPECIFIED, F32, {2, 4}, {32}).find("is not FORWARD"), std::string::npos);
  // A header that is not an Envelope at all.
  peer.socket.send(zmq::str_buffer("\xff\xff\xff not protobuf"), zmq::send_flags::none);
  auto env = peer.receive();
  ASSERT_TRUE(env.has_error());
  EXPECT_EQ(env.error().code(), proto::MALFORMED);
  EXPECT_NE(env.error().message().find("is not a symbiosis Envelope"), std::string::npos);
  EXPECT_EQ(executor_->stats().errors, 10u);
  expect_still_serving();
}

TEST_F(ExecutorTest, RequestBeforeHandshakeIsRefused) {
  RawPeer peer(executor_->endpoint(), /*handshake=*/false);
  EXPECT_NE(peer.request_error(0, proto::FORWARD, proto::FLOAT32, {1, 4}, {16}).find("send Hello first"),
            std::string::npos);
}

TEST_F(ExecutorTest, ExecutorErrorsReachTheClientAsExceptions) {
  auto client = connect();
  LayerInfo bogus = *client->find_layer("model.layers.0.mlp.up_proj");
  bogus.id = 42;
  try {
    client->forward(bogus, at::randn({1, 4}), true);
    FAIL() << "should have thrown";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("executor error (NOT_FOUND)"), std::string::npos) << e.what();
  }
}

TEST_F(ExecutorTest, ClientKilledMidRequestLeavesTheExecutorServing) {
  const std::string endpoint = executor_->endpoint();
  for (int i = 0; i < 3; ++i) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // The child uses only fresh ZeroMQ objects (nothing of the parent's threads), sends a
      // large request and dies before the answer.
      RawPeer peer(endpoint);
      proto::Envelope env;
      auto* r = env.mutable_request();
      r->set_request_id(1);
      r->set_layer_id(1);
      r->set_op(proto::FORWARD);
      r->set_dtype(proto::FLOAT32);
      r->add_shape(200);
      r->add_shape(4);
      peer.socket.send(wire::serialize(env), zmq::send_flags::sndmore);
      peer.socket.send(zmq::message_t(200 * 4 * 4), zmq::send_flags::none);
      ::raise(SIGKILL);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
  }
  expect_still_serving();
  EXPECT_EQ(executor_->stats().errors, 0u);
}

// [Overload]: each limit is refused with RESOURCE_EXHAUSTED naming it, its value and its flag,
// while the clients already served go on.
TEST_F(ExecutorTest, ClientsPastMaxClientsAreRefusedNamingTheLimitWhileOthersAreServed) {
  ExecutorOptions options;
  options.max_clients = 2;
  auto executor = testing::start_executor(checkpoint_->dir, options);
  ClientOptions client_options;
  client_options.transport = "tcp";
  auto first = testing::connect(*executor, client_options);
  RawPeer second(executor->endpoint());
  RawPeer third(executor->endpoint(), /*handshake=*/false);
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  third.socket.send(wire::serialize(hello), zmq::send_flags::none);
  const auto refusal = third.receive();
  ASSERT_TRUE(refusal.has_error());
  EXPECT_EQ(refusal.error().code(), proto::RESOURCE_EXHAUSTED);
  for (const char* part : {"max_clients", "2 clients", "--max-clients"}) {
    EXPECT_NE(refusal.error().message().find(part), std::string::npos) << refusal.error().message();
  }
  auto x = at::randn({3, 4});
  auto y = first->forward(*first->find_layer("model.layers.0.mlp.up_proj"), x, true);
  EXPECT_LT(relative_error(y, at::addmm(up_bias(), x, up_weight().t())), 1e-6);
  EXPECT_EQ(executor->stats().clients, 2u);
}

TEST_F(ExecutorTest, AHugeTenantNameIsRefusedNamingTheFieldAndTheLimit) {
  ExecutorOptions options;
  options.max_request_bytes = 4096;
  options.max_message_bytes = size_t{32} << 20;  // lets the 16 MB Hello be read, to be refused
  auto executor = testing::start_executor(checkpoint_->dir, options);
  RawPeer peer(executor->endpoint(), /*handshake=*/false);
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_tenant(std::string(size_t{16} << 20, 't'));
  peer.socket.send(wire::serialize(hello), zmq::send_flags::none);
  const auto refusal = peer.receive();
  ASSERT_TRUE(refusal.has_error());
  EXPECT_EQ(refusal.error().code(), proto::INVALID_ARGUMENT);
  EXPECT_NE(refusal.error().message().find("Hello.tenant of 16777216 bytes is over the limit of 128 bytes"),
            std::string::npos)
      << refusal.error().message().substr(0, 200);
  EXPECT_EQ(executor->stats().clients, 0u);  // nothing of it is kept
}

TEST_F(ExecutorTest, MessagesLargerThanMaxMessageBytesDropTheirSenderNotTheExecutor) {
  RawPeer peer(executor_->endpoint());  // max_message_bytes: 1 MiB + 64 KiB
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_tenant(std::string(size_t{2} << 20, 't'));
  peer.socket.set(zmq::sockopt::rcvtimeo, 500);
  peer.socket.send(wire::serialize(hello), zmq::send_flags::none);
  zmq::message_t answer;
  EXPECT_FALSE(peer.socket.recv(answer));  // disconnected, unanswered
  expect_still_serving();
}

long resident_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

TEST_F(ExecutorTest, AClientThatNeverReadsItsRepliesCannotGrowTheExecutor) {
  ExecutorOptions options;
  options.max_request_bytes = size_t{1} << 20;
  options.max_queued_messages = 8;
  auto executor = testing::start_executor(checkpoint_->dir, options);
  // The peer is in this process too: it takes in at most 2 replies, so that what grows is the executor.
  RawPeer peer(executor->endpoint(), /*handshake=*/true, /*receive_queue=*/2);
  uint32_t up_proj = 0;
  for (const auto& layer : executor->model().layers()) {
    if (layer.name == "model.layers.0.mlp.up_proj") up_proj = layer.id;
  }
  constexpr int64_t kTokens = 16384;  // 256 KiB in, 512 KiB out (up_proj: 4 -> 8 features)
  const std::vector<char> payload(kTokens * 4 * sizeof(float));
  auto send_request = [&](uint64_t id) {
    proto::Envelope env;
    auto* r = env.mutable_request();
    r->set_request_id(id);
    r->set_layer_id(up_proj);
    r->set_op(proto::FORWARD);
    r->set_dtype(proto::FLOAT32);
    r->add_shape(kTokens);
    r->add_shape(4);
    peer.socket.send(wire::serialize(env), zmq::send_flags::sndmore);
    peer.socket.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
  };
  // Warm-up, read: the allocator's pools are filled before the measure.
  for (uint64_t id = 1; id <= 8; ++id) {
    send_request(id);
    ASSERT_TRUE(peer.receive().has_reply());
  }
  const long before_kb = resident_kb();
  constexpr int kUnread = 1300;  // 650 MiB of replies, never read
  // One call at a time (each answered before the next is sent): this measures the replies held for
  // the peer. Calls sent faster than they are computed wait in the scheduler's inbox, which
  // max_queued_tokens is to bound (not yet: see docs/operating.md, Overload).
  for (int i = 0; i < kUnread; ++i) {
    send_request(100 + i);
    const auto answered = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (executor->stats().requests < 8u + i + 1 && std::chrono::steady_clock::now() < answered) {
      std::this_thread::yield();
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (executor->stats().requests < 8u + kUnread && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(executor->stats().requests, 8u + kUnread);
  const long growth_mb = (resident_kb() - before_kb) / 1024;
  EXPECT_LT(growth_mb, 64) << "the executor grew by " << growth_mb << " MB for a client that reads nothing";
  // Everyone else is served on.
  ClientOptions client_options;
  client_options.timeout_ms = 10000;
  auto other = testing::connect(*executor, client_options);
  auto x = at::randn({3, 4});
  auto y = other->forward(*other->find_layer("model.layers.0.mlp.up_proj"), x, true);
  EXPECT_LT(relative_error(y, at::addmm(up_bias(), x, up_weight().t())), 1e-6);
}

int memfd_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int count = 0;
  while (std::getline(maps, line)) count += line.find("memfd:") != std::string::npos;
  return count;
}

// [Proven placement]: a same-host client that claims another live process (here the executor's
// own) is not given a same-host transport, and one whose process ends is forgotten with its segments
// unmapped, so that dead or false same-host clients cannot pile up segments.
TEST_F(ExecutorTest, SameHostClientsThatClaimTheExecutorsPidOrDieLeaveNoSegmentsBehind) {
  const std::string endpoint = executor_->endpoint();
  const int segments_before = memfd_mappings();
  for (const bool claim_executor_pid : {true, false}) {
    const pid_t executor_pid = ::getpid();
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (claim_executor_pid) {
        RawPeer peer(endpoint, /*handshake=*/false);
        proto::Envelope hello;
        hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
        hello.mutable_hello()->set_transport("shm");
        *hello.mutable_hello()->mutable_placement() = local_placement("cpu");
        hello.mutable_hello()->mutable_placement()->set_pid(executor_pid);
        peer.socket.send(wire::serialize(hello), zmq::send_flags::none);
        auto challenge = peer.receive();
        if (!challenge.has_prove_host()) ::_exit(2);
        auto link = local::prove(challenge.prove_host(), 5000);
        const bool refused = !link.is_ok() && link.status().message().find("not proven") != std::string::npos;
        ::_exit(refused ? 0 : 1);
      }
      ClientOptions options;
      options.endpoint = endpoint;
      options.transport = "shm";
      options.timeout_ms = 10000;
      auto client = Client::connect(options);
      ::raise(SIGKILL);  // gone without a Goodbye, its segments mapped in the executor
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (claim_executor_pid) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the false claim was not refused: " << status;
    } else {
      EXPECT_TRUE(WIFSIGNALED(status));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((executor_->stats().clients > 0 || memfd_mappings() > segments_before) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(executor_->stats().clients, 0u);
    EXPECT_EQ(executor_->stats().same_host_clients, 0u);
    EXPECT_EQ(memfd_mappings(), segments_before);
  }
  expect_still_serving();
}

// [Opportunistic batching], lockstep: clients that each wait for their previous call's result meet
// in every batch, one call of each (the [Input observer]'s batch numbers), and no batch waits for
// the lockstep timeout (60 s here: the test would take minutes).
TEST_F(ExecutorTest, LockstepPacksOneCallOfEveryClientInEachBatch) {
  ExecutorOptions options;
  options.batching.policy = BatchingPolicy::kLockstep;
  options.batching.lockstep_timeout = std::chrono::milliseconds(60000);
  std::mutex mutex;
  std::map<uint64_t, std::vector<uint64_t>> batches;  // batch number -> its calls' client ids
  options.on_input = [&](uint64_t batch, uint64_t client_id, const LayerInfo&, LayerOp, const at::Tensor&) {
    std::lock_guard<std::mutex> lock(mutex);
    batches[batch].push_back(client_id);
  };
  auto executor = testing::start_executor(checkpoint_->dir, options);
  std::vector<std::shared_ptr<Client>> clients;
  for (const char* transport : {"tcp", "shm", "shm"}) {
    ClientOptions client_options;
    client_options.transport = transport;
    clients.push_back(testing::connect(*executor, client_options));
  }
  const auto* up = clients[0]->find_layer("model.layers.0.mlp.up_proj");
  constexpr int kRounds = 12;
  const auto started = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (auto& client : clients) {
    threads.emplace_back([&, client] {
      for (int r = 0; r < kRounds; ++r) {
        auto x = at::randn({1 + r, 4});
        if (r % 2 == 0) {
          client->forward(*up, x, true);
        } else {
          client->backward_input(*up, at::randn({1 + r, up->out_features}));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_EQ(batches.size(), static_cast<size_t>(kRounds)) << "took " << seconds << " s";
  for (const auto& [number, ids] : batches) {
    EXPECT_EQ(std::set<uint64_t>(ids.begin(), ids.end()).size(), clients.size()) << "batch " << number;
  }
}

// [Overload]: calls that would bring the tokens waiting to be batched past --max-queued-tokens are
// refused naming the limit and its flag, the calls already queued are served, a refused call sent
// again once the queue drains is served, and a call larger than the limit is served alone.
TEST_F(ExecutorTest, CallsPastMaxQueuedTokensAreRefusedNamingTheLimitAndServedWhenSentAgain) {
  ExecutorOptions options;
  options.max_queued_tokens = 40;
  // Lockstep holds a queue until every client has a call in it: the raw peer's calls wait for the
  // client's, however fast the executor is.
  options.batching.policy = BatchingPolicy::kLockstep;
  options.batching.lockstep_timeout = std::chrono::milliseconds(60000);
  auto executor = testing::start_executor(checkpoint_->dir, options);
  ClientOptions client_options;
  client_options.transport = "tcp";
  client_options.timeout_ms = 30000;
  auto client = testing::connect(*executor, client_options);
  const auto* up = client->find_layer("model.layers.0.mlp.up_proj");
  RawPeer peer(executor->endpoint());
  auto send_call = [&](uint64_t id, int64_t tokens) {
    proto::Envelope env;
    auto* r = env.mutable_request();
    r->set_request_id(id);
    r->set_layer_id(up->id);
    r->set_op(proto::FORWARD);
    r->set_dtype(proto::FLOAT32);
    r->add_shape(tokens);
    r->add_shape(4);
    peer.socket.send(wire::serialize(env), zmq::send_flags::sndmore);
    peer.socket.send(zmq::message_t(tokens * 4 * sizeof(float)), zmq::send_flags::none);
  };
  send_call(1, 16);
  send_call(2, 16);  // 32 tokens wait for the client's call
  send_call(3, 16);  // 48 > 40
  const auto refusal = peer.receive();
  ASSERT_TRUE(refusal.has_reply());
  EXPECT_EQ(refusal.reply().request_id(), 3u);
  EXPECT_EQ(refusal.reply().error().code(), proto::RESOURCE_EXHAUSTED);
  for (const char* part : {"16 tokens", "48 tokens", "limit of 40", "max_queued_tokens", "--max-queued-tokens"}) {
    EXPECT_NE(refusal.reply().error().message().find(part), std::string::npos) << refusal.reply().error().message();
  }
  // The client's call completes the queue: it and the two waiting calls are served.
  auto x = at::randn({3, 4});
  EXPECT_LT(relative_error(client->forward(*up, x, true), at::addmm(up_bias(), x, up_weight().t())), 1e-6);
  for (uint64_t id : {1, 2}) {
    const auto reply = peer.receive();
    ASSERT_TRUE(reply.has_reply());
    EXPECT_EQ(reply.reply().request_id(), id);
    EXPECT_EQ(reply.reply().error().code(), proto::OK) << reply.reply().error().message();
  }
  // Sent again, now that the queue has drained, the refused call is served.
  send_call(3, 16);
  EXPECT_LT(relative_error(client->forward(*up, x, true), at::addmm(up_bias(), x, up_weight().t())), 1e-6);
  const auto served = peer.receive();
  ASSERT_TRUE(served.has_reply());
  EXPECT_EQ(served.reply().request_id(), 3u);
  EXPECT_EQ(served.reply().error().code(), proto::OK) << served.reply().error().message();
  EXPECT_EQ(executor->stats().errors, 1u);
  // Into an empty queue any call goes, one larger than the limit too (--max-request-bytes bounds it).
  ExecutorOptions roomy_options;
  roomy_options.max_queued_tokens = 40;
  auto roomy = testing::start_executor(checkpoint_->dir, roomy_options);
  auto lone = testing::connect(*roomy, client_options);
  auto big = at::randn({64, 4});
  EXPECT_LT(relative_error(lone->forward(*up, big, true), at::addmm(up_bias(), big, up_weight().t())), 1e-6);
}

// [Buffer budget]: same-host clients' control segments and payload buffers count against
// --max-buffer-bytes, every client's together; a handshake or a registration past it is refused
// naming the limit and its flag, nothing of it is held, the others are served, and what a client
// held is given back when it leaves.
TEST_F(ExecutorTest, SharedMemoryPastMaxBufferBytesIsRefusedNamingTheLimitAndGivenBackWhenClientsLeave) {
  const uint64_t control = sizeof(shm::ControlBlock);
  const uint64_t payload = uint64_t{4} << 20;  // a shm client's first payload buffer
  ExecutorOptions options;
  options.max_buffer_bytes = 2 * control + payload + control / 2;  // two clients, one payload buffer
  auto executor = testing::start_executor(checkpoint_->dir, options);
  ClientOptions shm_options;
  shm_options.transport = "shm";
  shm_options.timeout_ms = 10000;
  auto first = testing::connect(*executor, shm_options);
  const LayerInfo up = *first->find_layer("model.layers.0.mlp.up_proj");  // kept past the first client
  auto x = at::randn({3, 4});
  const auto expected = at::addmm(up_bias(), x, up_weight().t());
  EXPECT_LT(relative_error(first->forward(up, x, true), expected), 1e-6);
  EXPECT_EQ(executor->stats().buffer_bytes, control + payload);
  auto expect_refusal = [&](const std::string& message, const char* what) {
    for (const std::string part :
         {std::string(what), std::string("limit of ") + std::to_string(options.max_buffer_bytes),
          std::string("max_buffer_bytes"), std::string("--max-buffer-bytes")}) {
      EXPECT_NE(message.find(part), std::string::npos) << message;
    }
  };
  // A second client's control segment fits; its payload buffer does not.
  auto second = testing::connect(*executor, shm_options);
  EXPECT_EQ(executor->stats().buffer_bytes, 2 * control + payload);
  expect_refusal(testing::error_of([&] { second->forward(up, x, true); }), "registering a payload buffer of 4194304");
  EXPECT_EQ(executor->stats().buffer_bytes, 2 * control + payload);  // nothing of it is held
  // A third client's control segment does not fit.
  expect_refusal(testing::error_of([&] { testing::connect(*executor, shm_options); }),
                 "a same-host client's control segment");
  // Clients without shared memory are served on.
  ClientOptions tcp_options;
  tcp_options.transport = "tcp";
  auto tcp = testing::connect(*executor, tcp_options);
  EXPECT_LT(relative_error(tcp->forward(up, x, true), expected), 1e-6);
  // The first client leaves: what it held is given back, and a new client gets its payload buffer.
  first.reset();
  second.reset();
  ASSERT_TRUE(testing::same_host_clients_become(*executor, 0));
  ASSERT_TRUE(testing::wait_until([&] { return executor->stats().buffer_bytes == 0; }, std::chrono::seconds(10)));
  auto third = testing::connect(*executor, shm_options);
  EXPECT_LT(relative_error(third->forward(up, x, true), expected), 1e-6);
  EXPECT_EQ(executor->stats().buffer_bytes, control + payload);
}

// [Disconnected peers]: a tcp client whose process dies (killed after a call, or gone right after its
// handshake without a Goodbye) is forgotten as soon as its connection closes, not after the ten
// minutes of the idle limit, so that dead clients do not fill --max-clients.
TEST_F(ExecutorTest, TcpClientsWhoseConnectionClosesAreForgottenAtOnce) {
  const std::string endpoint = executor_->endpoint();
  for (const bool after_a_call : {true, false}) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (after_a_call) {
        ClientOptions options;
        options.endpoint = endpoint;
        options.transport = "tcp";
        options.timeout_ms = 10000;
        auto client = Client::connect(options);
        client->forward(*client->find_layer("model.layers.0.mlp.up_proj"), at::randn({2, 4}), true);
        ::raise(SIGKILL);
      }
      RawPeer peer(endpoint);  // its Hello answered
      ::_exit(0);              // no Goodbye
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(testing::wait_until([&] { return executor_->stats().clients == 0; }, std::chrono::seconds(5)))
        << executor_->stats().clients << " clients still counted";
  }
  expect_still_serving();
}

}  // namespace
}  // namespace symbiosis
