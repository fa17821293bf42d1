// [Fair shares] (base_executor/overload.h) and [Back-pressure] (client_runtime/client.cpp): the
// executor's queue and buffer budget are shared fairly, so that a tenant that floods the executor
// is the one refused, and a client refused for overload sends its call again instead of failing.
// The rule itself; the client runtime's retries against an executor that refuses by script; and a
// flooding tenant beside two honest ones (tcp and shm) that train on, exactly as their monolithic
// runs do, while the flooder alone is refused.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "base_executor/executor.h"
#include "base_executor/overload.h"
#include "client_runtime/client.h"
#include "common/checkpoint.h"
#include "tests/test_util.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kTolerance = 1e-5;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---- The rule ----

// Alone, a client fills the whole queue, and is refused past it naming the limit, its flag and
// its share; the calls it had queued drain, and it may queue again.
TEST(OverloadTest, AClientAloneMayFillTheWholeQueue) {
  QueueShares queue(100);
  EXPECT_TRUE(queue.admit(1, 1, 40).is_ok());
  EXPECT_TRUE(queue.admit(1, 2, 40).is_ok());
  EXPECT_TRUE(queue.admit(1, 3, 20).is_ok());
  EXPECT_EQ(queue.queued(), 100);
  const auto refused = queue.admit(1, 4, 10);
  ASSERT_EQ(refused.code(), StatusCode::kResourceExhausted);
  for (const char* part : {"request 4 of 10 tokens", "to 110 tokens", "limit of 100", "max_queued_tokens",
                           "--max-queued-tokens", "this client's tenant holds 100 tokens", "fair share is 100",
                           "among 1 tenant with calls waiting", "send it again"}) {
    EXPECT_TRUE(contains(refused.message(), part)) << part << " not in: " << refused.message();
  }
  EXPECT_EQ(queue.queued(), 100);  // nothing of the refused call is counted
  queue.leave_inbox(1, 40);
  EXPECT_TRUE(queue.admit(1, 5, 40).is_ok());
  // Into an empty share any call goes, one larger than the limit too.
  QueueShares empty(100);
  EXPECT_TRUE(empty.admit(7, 1, 1000).is_ok());
  EXPECT_FALSE(empty.admit(7, 2, 1).is_ok());
}

// Two clients: the one that filled the queue is refused, the other keeps its share (half the
// limit) however full the queue is, and is refused only past it.
TEST(OverloadTest, UnderContentionEachClientKeepsItsShareAndTheOneHoldingMoreIsRefused) {
  QueueShares queue(100);
  ASSERT_TRUE(queue.admit(1, 1, 100).is_ok());  // the flooder fills the queue
  EXPECT_TRUE(queue.admit(2, 1, 30).is_ok());   // an empty share takes any call
  EXPECT_TRUE(queue.admit(2, 2, 20).is_ok());   // 50: within its share of 100 / 2
  const auto past_share = queue.admit(2, 3, 1);
  ASSERT_EQ(past_share.code(), StatusCode::kResourceExhausted);
  for (const char* part : {"this client's tenant holds 50 tokens", "fair share is 50", "among 2 tenants"}) {
    EXPECT_TRUE(contains(past_share.message(), part)) << part << " not in: " << past_share.message();
  }
  const auto flooder = queue.admit(1, 2, 1);
  ASSERT_EQ(flooder.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(contains(flooder.message(), "this client's tenant holds 100 tokens")) << flooder.message();
  EXPECT_EQ(queue.queued(1), 100);
  EXPECT_EQ(queue.queued(2), 50);
  // A third client comes: its share is a third, 33 tokens.
  EXPECT_TRUE(queue.admit(3, 1, 10).is_ok());
  EXPECT_TRUE(queue.admit(3, 2, 23).is_ok());
  EXPECT_FALSE(queue.admit(3, 3, 1).is_ok());
  // The flooder's calls are computed: it is served again, up to its share now that others wait.
  queue.leave_inbox(1, 100);
  EXPECT_EQ(queue.queued(), 83);
  EXPECT_TRUE(queue.admit(1, 3, 17).is_ok());  // the queue's room
  EXPECT_TRUE(queue.admit(1, 4, 16).is_ok());  // 33: its share of 100 / 3
  EXPECT_FALSE(queue.admit(1, 5, 1).is_ok());
}

// Under --keys a tenant is its key, and its connections hold one share together: a second
// connection buys no more of the queue. Clients without a tenant (no keys) hold a share each.
TEST(OverloadTest, ATenantsConnectionsHoldOneShareTogether) {
  QueueShares queue(90);
  queue.join(1, "mallory");
  queue.join(2, "mallory");
  queue.join(3, "alice");
  ASSERT_TRUE(queue.admit(1, 1, 60).is_ok());  // mallory's first connection fills two thirds
  ASSERT_TRUE(queue.admit(3, 1, 30).is_ok());  // alice the rest
  // Mallory's second connection holds nothing itself, but its tenant holds 60, past 90 / 2.
  const auto refused = queue.admit(2, 1, 1);
  ASSERT_EQ(refused.code(), StatusCode::kResourceExhausted);
  for (const char* part : {"this client's tenant holds 60 tokens", "fair share is 45", "among 2 tenants"}) {
    EXPECT_TRUE(contains(refused.message(), part)) << part << " not in: " << refused.message();
  }
  EXPECT_TRUE(queue.admit(3, 2, 15).is_ok());  // alice, within her share
  EXPECT_EQ(queue.queued(2), 0);
  // Without tenants the second connection is a tenant of its own: into its empty share, any call.
  QueueShares apart(90);
  ASSERT_TRUE(apart.admit(1, 1, 60).is_ok());
  ASSERT_TRUE(apart.admit(3, 1, 30).is_ok());
  EXPECT_TRUE(apart.admit(2, 1, 1).is_ok());
  // A tenant's clients that leave stop counting for it: a new connection of mallory's starts afresh.
  queue.leave(1);
  queue.leave(2);
  queue.join(4, "mallory");
  EXPECT_TRUE(queue.admit(4, 1, 1).is_ok());
}

// The calls in the Batcher count for their clients as those in the inbox do, and a call through a
// channel is checked against both without being counted twice.
TEST(OverloadTest, CallsInTheBatcherCountForTheirClients) {
  QueueShares queue(10);
  queue.note_batched({{1, 6}, {2, 4}});
  EXPECT_EQ(queue.queued(), 10);
  EXPECT_FALSE(queue.check(1, 1, 1).is_ok());  // 6 > its share of 5
  EXPECT_TRUE(queue.check(2, 1, 1).is_ok());   // 5 <= its share
  EXPECT_TRUE(queue.check(3, 1, 8).is_ok());   // an empty share
  EXPECT_EQ(queue.queued(), 10);               // check() counts nothing
  ASSERT_TRUE(queue.admit(2, 2, 1).is_ok());
  EXPECT_EQ(queue.queued(2), 5);
  queue.note_batched({});
  EXPECT_EQ(queue.queued(), 1);  // the admitted call, still in the inbox
}

// The buffer budget: a client alone may take all of it; a second keeps its share past the limit;
// one past its share is refused naming the limit, the flag and the share.
TEST(OverloadTest, PayloadBuffersAreSharedTheSameWay) {
  BufferBudget budget(100);
  ASSERT_TRUE(budget.take(100, "registering a payload buffer", {0, 1}).is_ok());
  EXPECT_TRUE(budget.take(40, "registering a payload buffer", {0, 2}).is_ok());
  EXPECT_EQ(budget.used(), 140u);
  const auto refused = budget.take(20, "registering a payload buffer", {40, 2});
  ASSERT_EQ(refused.code(), StatusCode::kResourceExhausted);
  for (const char* part : {"registering a payload buffer of 20 bytes", "limit of 100 bytes", "max_buffer_bytes",
                           "--max-buffer-bytes", "this client's tenant holds 40 bytes", "fair share is 50"}) {
    EXPECT_TRUE(contains(refused.message(), part)) << part << " not in: " << refused.message();
  }
  EXPECT_FALSE(budget.take(1, "registering a payload buffer", {100, 2}).is_ok());
  EXPECT_EQ(budget.used(), 140u);
  // Within its share but past twice the limit: refused (the bound on what shares may add).
  BufferBudget full(100);
  EXPECT_FALSE(full.take(195, "x", {0, 1}).is_ok());  // past the pool and the share of a client alone
  ASSERT_TRUE(full.take(100, "x", {0, 1}).is_ok());
  ASSERT_TRUE(full.take(50, "x", {0, 2}).is_ok());
  ASSERT_TRUE(full.take(33, "x", {0, 3}).is_ok());
  EXPECT_FALSE(full.take(25, "x", {0, 4}).is_ok());  // its share, but 208 > 200
}

// ---- Back-pressure in the client runtime ----

// An executor that knows one layer (4 -> 4, the identity) and refuses the first `refusals` calls
// with RESOURCE_EXHAUSTED (-1: every call), answering the rest with their input. Its Welcome says
// max_request_bytes 4096. Serves on a thread of its own until destroyed.
class ScriptedExecutor {
 public:
  explicit ScriptedExecutor(int refusals) : refusals_(refusals) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.bind("tcp://127.0.0.1:*");
    endpoint_ = socket_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] { serve(); });
  }
  ~ScriptedExecutor() {
    stop_ = true;
    thread_.join();
  }
  const std::string& endpoint() const { return endpoint_; }
  int calls() const { return calls_; }
  static LayerInfo layer() {
    LayerInfo layer;
    layer.name = "model.layers.0.mlp.up_proj";
    layer.in_features = layer.out_features = 4;
    return layer;
  }

 private:
  void serve() {
    while (!stop_) {
      zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(20)) == 0) continue;
      auto frames = wire::recv_all(socket_);
      proto::Envelope env;
      if (frames.size() < 2 || !wire::parse(frames[1], &env)) continue;
      const std::string identity(static_cast<const char*>(frames[0].data()), frames[0].size());
      if (env.has_hello()) {
        proto::Envelope welcome;
        auto* w = welcome.mutable_welcome();
        w->set_client_id(1);
        w->set_model_hash("scripted");
        w->set_transport("tcp");
        w->set_max_request_bytes(4096);
        *w->add_layers() = wire::to_proto(layer());
        wire::send_to(socket_, identity, welcome);
      } else if (env.has_request()) {
        const auto& r = env.request();
        const int number = ++calls_;
        if (refusals_ < 0 || number <= refusals_) {
          const Status busy(StatusCode::kResourceExhausted,
                            "request " + std::to_string(r.request_id()) +
                                " would bring the calls waiting to be batched over the executor's limit "
                                "(max_queued_tokens; raise it with --max-queued-tokens); send it again");
          wire::send_to(socket_, identity, wire::error_envelope(r.request_id(), busy, /*as_reply=*/true));
          continue;
        }
        proto::Envelope reply;
        reply.mutable_reply()->set_request_id(r.request_id());
        reply.mutable_reply()->set_dtype(r.dtype());
        for (const int64_t d : r.shape()) reply.mutable_reply()->add_shape(d);
        std::vector<zmq::message_t> payload;
        payload.push_back(std::move(frames.at(2)));  // the identity's result is its input
        wire::send_to(socket_, identity, reply, payload);
      }
    }
  }

  const int refusals_;
  std::atomic<int> calls_{0};
  std::atomic<bool> stop_{false};
  zmq::context_t context_{1};
  zmq::socket_t socket_{context_, zmq::socket_type::router};
  std::string endpoint_;
  std::thread thread_;
};

std::shared_ptr<Client> connect_to(const ScriptedExecutor& executor, int timeout_ms) {
  ClientOptions options;
  options.endpoint = executor.endpoint();
  options.transport = "tcp";
  options.timeout_ms = timeout_ms;
  options.reconnect_ms = 0;
  return Client::connect(options);
}

// A call refused for overload is sent again after a pause until the executor takes it: the caller
// sees its result, as from a call never refused.
TEST(OverloadTest, ACallRefusedForOverloadIsSentAgainUntilTaken) {
  ScriptedExecutor executor(/*refusals=*/5);
  auto client = connect_to(executor, 30000);
  const auto x = at::randn({3, 4});
  const auto y = client->forward(*client->find_layer(ScriptedExecutor::layer().name), x, true);
  EXPECT_TRUE(at::equal(y, x));
  EXPECT_EQ(executor.calls(), 6);
  EXPECT_EQ(client->calls(), 1u);  // one call, sent six times
  // The next call is not refused: sent once.
  EXPECT_TRUE(at::equal(client->forward(*client->find_layer(ScriptedExecutor::layer().name), x, true), x));
  EXPECT_EQ(executor.calls(), 7);
}

// An executor that refuses for longer than the call timeout: the call fails naming the overload,
// the time and the number of times it was sent, the timeout and its option, and the refusal.
TEST(OverloadTest, ACallRefusedUntilItsTimeoutFailsNamingTheOverloadAndHowLongItRetried) {
  ScriptedExecutor executor(/*refusals=*/-1);
  auto client = connect_to(executor, 300);
  const std::string error = testing::error_of([&] {
    client->forward(*client->find_layer(ScriptedExecutor::layer().name), at::randn({3, 4}), true);
  });
  for (const char* part : {"is overloaded", "on layer 'model.layers.0.mlp.up_proj' (3 tokens)", "ms of retries",
                           "call timeout of 300 ms", "timeout_ms", "RESOURCE_EXHAUSTED", "--max-queued-tokens"}) {
    EXPECT_TRUE(contains(error, part)) << part << " not in: " << error;
  }
  EXPECT_GT(executor.calls(), 1);
  EXPECT_TRUE(contains(error, "(3 tokens) " + std::to_string(executor.calls()) + " times")) << error;
}

// RESOURCE_EXHAUSTED for a call over the executor's --max-request-bytes is no overload: it would
// be refused again, so it fails at once, sent once.
TEST(OverloadTest, ACallOverMaxRequestBytesIsNotSentAgain) {
  ScriptedExecutor executor(/*refusals=*/-1);
  auto client = connect_to(executor, 30000);
  const std::string error = testing::error_of([&] {
    client->forward(*client->find_layer(ScriptedExecutor::layer().name), at::randn({2000, 4}), true);
  });
  EXPECT_TRUE(contains(error, "RESOURCE_EXHAUSTED")) << error;
  EXPECT_FALSE(contains(error, "is overloaded")) << error;
  EXPECT_EQ(executor.calls(), 1);
}

// ---- A flood beside honest tenants ----

// One scrape of the executor's metrics: each sample by its name and labels.
std::map<std::string, double> scrape(const std::string& url) {
  const auto path_at = url.find('/', std::string("http://").size());
  httplib::Client http(url.substr(0, path_at));
  auto answer = http.Get(url.substr(path_at));
  EXPECT_TRUE(answer) << "no answer from " << url;
  std::map<std::string, double> samples;
  if (!answer) return samples;
  std::istringstream lines(answer->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto space = line.rfind(' ');
    samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return samples;
}

// A tenant that speaks the protocol by hand over tcp and keeps kOutstanding calls of kTokens
// tokens in flight on one layer, sending the next as soon as any is answered, refused or not.
class Flooder {
 public:
  static constexpr int kOutstanding = 16;
  static constexpr int64_t kTokens = 64;

  Flooder(const std::string& endpoint, const std::string& layer_name) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.set(zmq::sockopt::rcvtimeo, 10000);
    socket_.connect(endpoint);
    proto::Envelope hello;
    hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
    hello.mutable_hello()->set_tenant("mallory");
    hello.mutable_hello()->set_transport("tcp");
    const auto welcome = testing::exchange(socket_, hello);
    EXPECT_TRUE(welcome.has_welcome()) << welcome.DebugString();
    client_id = welcome.welcome().client_id();
    for (const auto& layer : welcome.welcome().layers()) {
      if (layer.name() == layer_name) layer_ = wire::from_proto(layer);
    }
    EXPECT_EQ(layer_.name, layer_name);
    payload_.assign(kTokens * layer_.in_features * at::elementSize(layer_.dtype), 0);
  }

  // Floods until stop() (on its own thread), then waits for the answers to the calls in flight.
  void start() {
    thread_ = std::thread([this] {
      int outstanding = 0;
      while (true) {
        const bool stopping = stopping_;
        if (stopping && outstanding == 0) break;
        while (!stopping && outstanding < kOutstanding) {
          send_call();
          outstanding++;
        }
        zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
        if (zmq::poll(&item, 1, std::chrono::milliseconds(stopping ? 10000 : 5)) == 0) {
          if (stopping) break;  // answers that never came: counted below
          continue;
        }
        auto frames = wire::recv_all(socket_);
        proto::Envelope answer;
        if (frames.empty() || !wire::parse(frames[0], &answer) || !answer.has_reply()) {
          other_answers++;
        } else if (answer.reply().error().code() == proto::RESOURCE_EXHAUSTED) {
          refused++;
          std::lock_guard<std::mutex> lock(mutex_);
          refused_cv_.notify_all();
        } else if (answer.reply().error().code() == proto::OK) {
          served++;
        } else {
          other_answers++;
        }
        outstanding--;
      }
      unanswered = outstanding;
    });
  }
  void stop() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Waits until the executor has refused the flooder once (or 60 s have passed: false).
  bool wait_refused() {
    std::unique_lock<std::mutex> lock(mutex_);
    return refused_cv_.wait_for(lock, std::chrono::seconds(60), [&] { return refused > 0; });
  }
  ~Flooder() { stop(); }

  uint64_t client_id = 0;
  std::atomic<uint64_t> refused{0}, served{0}, other_answers{0};
  int unanswered = 0;

 private:
  void send_call() {
    proto::Envelope env;
    auto* r = env.mutable_request();
    r->set_request_id(next_request_id_++);
    r->set_layer_id(layer_.id);
    r->set_op(proto::FORWARD);
    r->set_dtype(wire::to_proto(layer_.dtype));
    r->add_shape(kTokens);
    r->add_shape(layer_.in_features);
    socket_.send(wire::serialize(env), zmq::send_flags::sndmore);
    socket_.send(zmq::message_t(payload_.data(), payload_.size()), zmq::send_flags::none);
  }

  zmq::context_t context_{1};
  zmq::socket_t socket_{context_, zmq::socket_type::dealer};
  LayerInfo layer_;
  std::vector<char> payload_;
  uint64_t next_request_id_ = 1;
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::condition_variable refused_cv_;
  std::thread thread_;
};

// A tenant floods the executor over tcp, many calls past its share of a small --max-queued-tokens,
// while two honest tenants fine-tune, one over tcp and one over shm: both finish, every loss, logit
// and gradient equal to their monolithic runs'; the executor refuses the flooder, and only the
// flooder (its statistics count RESOURCE_EXHAUSTED by tenant); it serves on afterwards.
TEST(OverloadTest, AFloodingTenantIsRefusedWhileHonestTenantsTrainExactlyAsAlone) {
  const auto dir = testing::make_checkpoint("tiny-llama");
  const auto checkpoint = Checkpoint::open(dir);
  const std::string flooded_layer = "model.layers.0.self_attn.q_proj";
  ExecutorOptions options;
  options.max_queued_tokens = 96;  // an honest call: 24 tokens; the flooder's: 64, 16 in flight
  options.metrics_listen = "127.0.0.1:0";
  // [Input observer]: the flooder's first call is held in its batch until the executor has refused
  // the flooder once, so that the flood has filled the queue, however fast the executor computes,
  // before the honest tenants start.
  std::atomic<uint64_t> flooder_id{0};
  std::mutex release_mutex;
  std::condition_variable release_cv;
  bool released = false;
  options.on_input = [&](uint64_t, uint64_t client_id, const LayerInfo&, LayerOp, const at::Tensor&) {
    if (client_id != flooder_id.load()) return;
    std::unique_lock<std::mutex> lock(release_mutex);
    release_cv.wait_for(lock, std::chrono::seconds(60), [&] { return released; });
  };
  auto executor = testing::start_executor(dir, options);

  Flooder flooder(executor->endpoint(), flooded_layer);
  flooder_id = flooder.client_id;
  flooder.start();
  const bool flood_refused = flooder.wait_refused();
  {
    std::lock_guard<std::mutex> lock(release_mutex);
    released = true;
  }
  release_cv.notify_all();
  ASSERT_TRUE(flood_refused) << "the executor never refused the flooder";

  // The honest tenants, each beside its monolithic run; the runs are made here (their adapters are
  // drawn from the global generator), trained on threads of their own.
  struct Honest {
    std::string tenant, transport;
    std::shared_ptr<Client> client;
    std::unique_ptr<testing::TrainingRun> split, mono;
  };
  std::vector<Honest> honest;
  for (const auto& [tenant, transport] : {std::pair<std::string, std::string>{"alice", "tcp"}, {"bob", "shm"}}) {
    ClientOptions client_options;
    client_options.tenant = tenant;
    client_options.transport = transport;
    client_options.timeout_ms = 60000;
    Honest h{tenant, transport, testing::connect(*executor, *checkpoint, client_options), nullptr, nullptr};
    ASSERT_EQ(h.client->transport(), transport);
    const auto adapter = testing::lora_adapter(testing::moving_lora());
    h.split = std::make_unique<testing::TrainingRun>(
        testing::make_training_run(*checkpoint, h.client, adapter, {}, 1e-2, 1234));
    h.mono = std::make_unique<testing::TrainingRun>(
        testing::make_training_run(*checkpoint, nullptr, adapter, {}, 1e-2, 1234));
    honest.push_back(std::move(h));
  }
  at::manual_seed(7);
  const auto ids = at::randint(0, 200, {2, 12}, at::kLong);
  std::vector<std::thread> training;
  for (auto& h : honest) {
    training.emplace_back([&h, &ids] {
      try {
        testing::expect_same_training(*h.split, *h.mono, ids, 4, kTolerance);
      } catch (const std::exception& e) {
        ADD_FAILURE() << h.tenant << " (" << h.transport << ") aborted during the flood: " << e.what();
      }
    });
  }
  for (auto& t : training) t.join();
  flooder.stop();

  EXPECT_GT(flooder.refused.load(), 0u);
  EXPECT_EQ(flooder.other_answers.load(), 0u);
  EXPECT_EQ(flooder.unanswered, 0);
  // The executor's statistics, by tenant: the flooder's refusals, every one; none for the others,
  // who were served.
  std::map<std::string, double> m;
  testing::wait_until(
      [&] {
        m = scrape(executor->metrics_url());
        return m["symbiosis_tenant_errors_total{tenant=\"mallory\",code=\"RESOURCE_EXHAUSTED\"}"] >=
               static_cast<double>(flooder.refused.load());
      },
      std::chrono::seconds(5));
  EXPECT_EQ(m["symbiosis_tenant_errors_total{tenant=\"mallory\",code=\"RESOURCE_EXHAUSTED\"}"],
            static_cast<double>(flooder.refused.load()));
  EXPECT_EQ(m["symbiosis_errors_total{code=\"RESOURCE_EXHAUSTED\"}"], static_cast<double>(flooder.refused.load()));
  for (const char* tenant : {"alice", "bob"}) {
    EXPECT_EQ(m[std::string("symbiosis_tenant_errors_total{tenant=\"") + tenant + "\",code=\"RESOURCE_EXHAUSTED\"}"], 0)
        << tenant;
    EXPECT_GT(m[std::string("symbiosis_tenant_requests_total{tenant=\"") + tenant + "\"}"], 0) << tenant;
  }
  EXPECT_GT(m["symbiosis_tenant_requests_total{tenant=\"mallory\"}"], 0);

  // Alive afterwards: a new tenant's call is served, and equals the layer's product.
  ClientOptions after_options;
  after_options.tenant = "carol";
  after_options.timeout_ms = 10000;
  auto after = testing::connect(*executor, *checkpoint, after_options);
  const auto x = at::randn({5, 64});
  const auto weight = checkpoint->tensor(flooded_layer + ".weight").to(at::kFloat);
  EXPECT_LT(testing::relative_error(after->forward(*after->find_layer(flooded_layer), x, false), at::mm(x, weight.t())),
            kTolerance);
}

}  // namespace
}  // namespace symbiosis
