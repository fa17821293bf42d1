#include "tests/test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/process.h"
#include "common/checkpoint.h"
#include "transport/local_socket.h"
#include "transport/zmq_wire.h"

extern char** environ;

namespace symbiosis::testing {

pid_t spawn(const std::vector<std::string>& args) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  TORCH_CHECK(rc == 0, "cannot start ", args[0], ": ", std::strerror(rc));
  return pid;
}

bool exited_ok(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

namespace {

// [Temporary folders] The folders temp_dir made go once the test program's tests have all passed;
// after a failure they stay, for the messages that name them. (Left for good, a few thousand runs
// of the suite had filled 11 GB of /tmp.)
class TemporaryFolders : public ::testing::Environment {
 public:
  // Registered with GoogleTest, which owns it and tears it down after the last test.
  static TemporaryFolders& instance() {
    static auto* folders = static_cast<TemporaryFolders*>(::testing::AddGlobalTestEnvironment(new TemporaryFolders()));
    return *folders;
  }
  void add(std::filesystem::path dir) {
    std::lock_guard<std::mutex> lock(mutex_);
    dirs_.push_back(std::move(dir));
  }
  void TearDown() override {
    if (!::testing::UnitTest::GetInstance()->Passed()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& dir : dirs_) {
      std::error_code ignored;  // a folder a process of the test still writes to may stay
      std::filesystem::remove_all(dir, ignored);
    }
    dirs_.clear();
  }

 private:
  std::mutex mutex_;
  std::vector<std::filesystem::path> dirs_;
};

}  // namespace

std::filesystem::path temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp failed for ", pattern);
  TemporaryFolders::instance().add(pattern);
  return pattern;
}

// Tests live in <build>/tests/<part>/..., mirroring the source tree; the build directory is found
// from the running test (bench::build_dir), so a build carried to another machine (the GPU
// machine) finds its programs.
std::string binary(const std::string& relative) { return (bench::build_dir() / relative).string(); }

std::filesystem::path make_checkpoint(const std::string& preset, const std::string& extra_args) {
  static std::mutex mutex;
  static std::map<std::string, std::filesystem::path> made;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = preset + "|" + extra_args;
  if (auto it = made.find(key); it != made.end()) return it->second;
  auto dir = temp_dir("symbiosis-" + preset) / "model";
  const std::string command = binary("tools/symbiosis-make-checkpoint") + " --preset " + preset + " --out " +
                              dir.string() + " " + extra_args + " > /dev/null";
  TORCH_CHECK(std::system(command.c_str()) == 0, "failed: ", command);
  made[key] = dir;
  return dir;
}

std::unique_ptr<Executor> start_executor(const std::filesystem::path& model, ExecutorOptions options) {
  options.model_dir = model;
  options.listen = "tcp://127.0.0.1:*";
  return Executor::start(options);
}

std::vector<std::unique_ptr<Executor>> start_parts(const std::filesystem::path& model, int count,
                                                   ExecutorOptions options, const std::vector<std::string>& devices) {
  // Several parts in one process are several process groups in one process, and Torch 2.11's flight
  // recorder (one per process) writes its map of groups before it takes its lock
  // (FlightRecorder::recordWithResetEnabled): two parts' first rounds at once crashed it about one
  // run in twenty on a busy host. A part process of its own has one group and keeps the recorder.
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  options.parts.rendezvous = free_loopback_rendezvous();
  options.parts.world_size = count;
  options.threads = 1;  // the parts share this host's cores
  std::vector<std::future<std::unique_ptr<Executor>>> starting;
  for (int rank = 0; rank < count; ++rank) {
    options.parts.rank = rank;
    if (rank < static_cast<int>(devices.size())) options.device = devices[rank];
    starting.push_back(std::async(std::launch::async, [model, options] { return start_executor(model, options); }));
  }
  std::vector<std::unique_ptr<Executor>> parts;
  for (auto& part : starting) parts.push_back(part.get());
  return parts;
}

LaunchedParts launch_parts(const std::filesystem::path& model, const std::vector<std::string>& launcher_args, int count,
                           const std::filesystem::path& logs) {
  std::vector<std::string> args = {binary("base_executor/symbiosis-executor"),
                                   "--model",
                                   model.string(),
                                   "--listen",
                                   "tcp://127.0.0.1:*",
                                   "--part-timeout",
                                   "5000"};
  args.insert(args.end(), launcher_args.begin(), launcher_args.end());
  LaunchedParts launched;
  launched.launcher = bench::spawn(args, logs / "out", logs / "err");
  launched.endpoints = bench::wait_ready(launched.launcher, logs / "out", count, 60'000);
  const std::string pid = std::to_string(launched.launcher);
  std::ifstream children("/proc/" + pid + "/task/" + pid + "/children");
  for (pid_t child; children >> child;) launched.pids.push_back(child);
  return launched;
}

std::shared_ptr<Client> connect(const Executor& executor, ClientOptions options) {
  options.endpoint = executor.endpoint();
  return Client::connect(options);
}

std::shared_ptr<Client> connect(const Executor& executor, const Checkpoint& checkpoint, ClientOptions options) {
  options.expected_model_hash = checkpoint.model_hash();
  return connect(executor, std::move(options));
}

ServedModel serve_model(const std::string& preset, const ClientOptions& client_options) {
  ServedModel served;
  served.dir = make_checkpoint(preset);
  served.checkpoint = Checkpoint::open(served.dir);
  served.executor = start_executor(served.dir);
  served.client = connect(*served.executor, *served.checkpoint, client_options);
  return served;
}

AddAdapter lora_adapter(const LoraConfig& lora) {
  return [lora](torch::nn::Module& model) { return add_lora(model, lora); };
}

LoraConfig moving_lora() {
  LoraConfig lora;
  lora.r = 4;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  lora.init_b_zero = false;
  return lora;
}

TrainingRun make_training_run(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                              const AddAdapter& add_adapter, const CausalLMOptions& options, double lr, uint64_t seed) {
  TrainingRun run;
  run.lm = open_causal_lm(checkpoint, client, options);
  at::manual_seed(seed);
  run.adapter = add_adapter(*run.lm.module);
  run.optimizer = std::make_unique<torch::optim::AdamW>(run.adapter, torch::optim::AdamWOptions(lr));
  return run;
}

void expect_same_training(TrainingRun& split, TrainingRun& mono, const at::Tensor& ids, int steps, double tolerance,
                          const at::Tensor& attention_mask, const at::Tensor& labels,
                          std::optional<double> adapter_tolerance) {
  ASSERT_FALSE(split.adapter.empty());
  ASSERT_EQ(split.adapter.size(), mono.adapter.size());
  const at::Tensor& targets = labels.defined() ? labels : ids;
  for (int step = 0; step < steps; ++step) {
    std::vector<at::Tensor> logits, losses;
    for (TrainingRun* run : {&split, &mono}) {
      run->optimizer->zero_grad();
      logits.push_back(run->lm.forward(ids, attention_mask));
      losses.push_back(causal_lm_loss(logits.back(), targets));
      losses.back().backward();
    }
    EXPECT_LT(relative_error(logits[0], logits[1]), tolerance) << "step " << step;
    EXPECT_LT(relative_error(losses[0], losses[1]), tolerance) << "step " << step;
    for (size_t i = 0; i < split.adapter.size(); ++i) {
      ASSERT_TRUE(split.adapter[i].grad().defined()) << "adapter tensor " << i;
      EXPECT_GT(mono.adapter[i].grad().abs().max().item<double>(), 0.0) << "adapter tensor " << i;
      EXPECT_LT(relative_error(split.adapter[i].grad(), mono.adapter[i].grad()), tolerance)
          << "step " << step << ", adapter tensor " << i;
    }
    split.optimizer->step();
    mono.optimizer->step();
  }
  for (size_t i = 0; i < split.adapter.size(); ++i) {
    EXPECT_LT(relative_error(split.adapter[i], mono.adapter[i]), adapter_tolerance.value_or(tolerance))
        << "adapter tensor " << i;
  }
}

proto::Envelope exchange(zmq::socket_t& socket, const proto::Envelope& envelope) {
  socket.send(wire::serialize(envelope), zmq::send_flags::none);
  auto frames = wire::recv_all(socket);
  proto::Envelope answer;
  EXPECT_TRUE(!frames.empty() && wire::parse(frames[0], &answer));
  return answer;
}

ProvenPeer hello_and_prove(zmq::socket_t& socket, const proto::Envelope& hello) {
  ProvenPeer peer;
  peer.answer = exchange(socket, hello);
  if (!peer.answer.has_prove_host()) return peer;
  auto link = local::prove(peer.answer.prove_host(), 10000);
  EXPECT_TRUE(link.is_ok()) << link.status().message();
  if (!link.is_ok()) return peer;
  peer.link = std::move(link.value().connection);
  peer.descriptors = std::move(link.value().descriptors);
  auto frames = wire::recv_all(socket);
  EXPECT_TRUE(!frames.empty() && wire::parse(frames[0], &peer.answer));
  return peer;
}

proto::Envelope setup_exchange(zmq::socket_t& socket, int link, const proto::Envelope& envelope, int descriptor) {
  local::send(link, envelope, descriptor >= 0 ? std::vector<int>{descriptor} : std::vector<int>{});
  auto frames = wire::recv_all(socket);
  proto::Envelope answer;
  EXPECT_TRUE(!frames.empty() && wire::parse(frames[0], &answer));
  return answer;
}

size_t forward_calls(const Client& client) {
  size_t calls = client.layers().size();
  for (const auto& group : client.groups()) {
    if (group.activation.empty()) calls -= group.members.size() - 1;  // [MLP blocks] need no gradient
  }
  return calls;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

int shell(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

at::Tensor read_safetensors_f32(const std::filesystem::path& file, const std::string& name) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << file;
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  const auto entry = nlohmann::json::parse(header).at(name);
  EXPECT_EQ(entry.at("dtype").get<std::string>(), "F32");
  const auto offsets = entry.at("data_offsets").get<std::vector<size_t>>();
  auto out = at::empty(entry.at("shape").get<std::vector<int64_t>>(), at::kFloat);
  in.seekg(static_cast<std::streamoff>(8 + header_len + offsets[0]));
  in.read(static_cast<char*>(out.data_ptr()), static_cast<std::streamsize>(offsets[1] - offsets[0]));
  return out;
}

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  auto a64 = a.detach().to(at::kDouble);
  auto b64 = b.detach().to(at::kDouble);
  TORCH_CHECK(a64.sizes() == b64.sizes(), "shapes differ: ", a64.sizes(), " vs ", b64.sizes());
  const double scale = b64.abs().max().item<double>();
  const double diff = (a64 - b64).abs().max().item<double>();
  if (std::isnan(diff) || std::isnan(scale)) return std::numeric_limits<double>::infinity();  // NaN: no match
  return scale == 0 ? diff : diff / scale;
}

bool wait_until(const std::function<bool()>& ready, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

TwoLayerCheckpoint write_two_layer_checkpoint(const std::string& prefix, uint64_t seed, bool with_norms_and_head) {
  TwoLayerCheckpoint c{temp_dir(prefix), {}, {}, {}};
  at::manual_seed(seed);
  c.q = at::randn({8, 4});
  c.up_weight = at::randn({6, 4});
  c.up_bias = at::randn({6});
  std::vector<std::pair<std::string, at::Tensor>> tensors = {{"model.embed_tokens.weight", at::randn({10, 4})},
                                                             {"model.layers.0.self_attn.q_proj.weight", c.q},
                                                             {"model.layers.0.mlp.up_proj.weight", c.up_weight},
                                                             {"model.layers.0.mlp.up_proj.bias", c.up_bias}};
  if (with_norms_and_head) {
    tensors.push_back({"model.layers.0.input_layernorm.weight", at::ones({4})});
    tensors.push_back({"model.norm.weight", at::ones({4})});
    tensors.push_back({"lm_head.weight", at::randn({10, 4})});
  }
  write_safetensors(c.dir / "model.safetensors", tensors);
  std::ofstream(c.dir / "config.json") << R"({"model_type": "llama", "hidden_size": 4})";
  return c;
}

bool same_host_clients_become(const Executor& executor, uint64_t n) {
  return wait_until([&] { return executor.stats().same_host_clients == n; }, std::chrono::seconds(10));
}

ExecutorProcess::ExecutorProcess(const std::filesystem::path& model, std::vector<std::string> args)
    : args_(std::move(args)), logs_(temp_dir("executor-process")) {
  start(model, "tcp://127.0.0.1:*");
}

ExecutorProcess::~ExecutorProcess() {
  wait_started();
  if (pid_ > 0) bench::stop(pid_);
}

void ExecutorProcess::end(int signal) {
  ASSERT_EQ(::kill(pid_, signal), 0);
  ::waitpid(pid_, nullptr, 0);
  pid_ = 0;
}

void ExecutorProcess::restart(int signal, const std::filesystem::path& model, std::chrono::milliseconds pause) {
  end(signal);
  restarting_ = std::thread([this, model, pause] {
    std::this_thread::sleep_for(pause);
    start(model, endpoint_);
  });
}

void ExecutorProcess::wait_started() {
  if (restarting_.joinable()) restarting_.join();
}

void ExecutorProcess::start(const std::filesystem::path& model, const std::string& listen) {
  std::vector<std::string> args = {"--model", model.string(), "--listen", listen};
  args.insert(args.end(), args_.begin(), args_.end());
  const auto process = bench::start_executor(args, logs_ / std::to_string(starts_++));
  pid_ = process.pid;
  endpoint_ = process.endpoint;
}

}  // namespace symbiosis::testing
