#pragma once
// Shared set-up for tests: temporary directories, random checkpoints made by the project's
// tool, an in-process executor on a free loopback port, and relative comparisons.
#include <ATen/ATen.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <sys/types.h>
#include <thread>
#include <vector>

#include <torch/optim/adamw.h>
#include <zmq.hpp>

#include "base_executor/executor.h"
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "common/unique_fd.h"
#include "symbiosis.pb.h"

namespace symbiosis::testing {

// A new folder under the system's temporary one, removed after the program's tests if they all
// passed ([Temporary folders] in test_util.cpp).
std::filesystem::path temp_dir(const std::string& prefix);
// Runs symbiosis-make-checkpoint --preset PRESET (cached per process).
std::filesystem::path make_checkpoint(const std::string& preset, const std::string& extra_args = "");
std::unique_ptr<Executor> start_executor(const std::filesystem::path& model, ExecutorOptions options = {});
// [Parts] (base_executor/parts.h): `count` executors in this process, the parts of one sharded
// executor serving `model` (each with one CPU thread a GEMM), started in threads of their own since
// they join each other; part r on devices[r] where given, else on options.device.
std::vector<std::unique_ptr<Executor>> start_parts(const std::filesystem::path& model, int count,
                                                   ExecutorOptions options = {},
                                                   const std::vector<std::string>& devices = {});
// [Parts]: a sharded executor started by symbiosis-executor's launcher (`launcher_args` after
// --model, e.g. {"--parts", "2"} or {"--gpus", "0,1"}; --listen tcp://127.0.0.1:* and a part
// timeout of 5 s are added), its output in `logs` (out, err): the launcher's pid, its `count` parts'
// pids and their endpoints in rank order, once all are ready (at most 60 s; fewer where not).
struct LaunchedParts {
  pid_t launcher = 0;
  std::vector<std::string> endpoints;
  std::vector<pid_t> pids;
};
LaunchedParts launch_parts(const std::filesystem::path& model, const std::vector<std::string>& launcher_args, int count,
                           const std::filesystem::path& logs);
// A client of `executor`: `options` with the executor's endpoint and, when `checkpoint` is given,
// its model hash as the expected one.
std::shared_ptr<Client> connect(const Executor& executor, ClientOptions options = {});
std::shared_ptr<Client> connect(const Executor& executor, const Checkpoint& checkpoint, ClientOptions options = {});
// What a split run needs: a preset's checkpoint (make_checkpoint), an executor serving it in this
// process and a client connected to it (connect, with `client_options`). Members are destroyed
// client first.
struct ServedModel {
  std::filesystem::path dir;
  std::shared_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Executor> executor;
  std::shared_ptr<Client> client;
};
ServedModel serve_model(const std::string& preset, const ClientOptions& client_options = {});
// max|a - b| / max|b|; infinity where either holds a NaN
double relative_error(const at::Tensor& a, const at::Tensor& b);
// The message (without backtrace) of the c10::Error that f throws, or "(no error)".
std::string error_of(const std::function<void()>& f);

// A causal LM with an adapter and its optimizer, split (client) or monolithic (nullptr).
struct TrainingRun {
  CausalLM lm;
  std::vector<at::Tensor> adapter;
  std::unique_ptr<torch::optim::AdamW> optimizer;
};
// Attaches an adapter to the model and returns its trainable tensors.
using AddAdapter = std::function<std::vector<at::Tensor>(torch::nn::Module&)>;
AddAdapter lora_adapter(const LoraConfig& lora);
// A small LoRA with a non-zero B, so that its first steps already move the loss: rank 4 on
// q_proj, v_proj and down_proj.
LoraConfig moving_lora();
// The adapter's initialization is drawn from `seed`, so split and monolithic runs start equal.
TrainingRun make_training_run(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                              const AddAdapter& add_adapter, const CausalLMOptions& options, double lr, uint64_t seed);
// Trains both runs `steps` AdamW steps on `ids` (with `attention_mask` and `labels`, which default
// to none and `ids`), expecting logits, loss and every adapter gradient at each step, and every
// adapter tensor at the end, to agree within `tolerance` (the adapters within `adapter_tolerance`
// where given: AdamW's sign-like steps enlarge differences in the last bits of the gradients).
void expect_same_training(TrainingRun& split, TrainingRun& mono, const at::Tensor& ids, int steps, double tolerance,
                          const at::Tensor& attention_mask = {}, const at::Tensor& labels = {},
                          std::optional<double> adapter_tolerance = std::nullopt);
// Sends `envelope` on a connected DEALER and returns the answer; one that does not parse fails the
// calling test. (Tests that speak the protocol by hand.)
proto::Envelope exchange(zmq::socket_t& socket, const proto::Envelope& envelope);

// A same-host handshake by hand, as the client runtime makes it ([Proven placement] in
// transport/local_socket.h): the Hello; the proof on the executor's local socket, when the executor
// asks for one; the answer that follows (a Welcome, or an error). `link` then takes set-up messages.
struct ProvenPeer {
  proto::Envelope answer;
  UniqueFd link;
  std::vector<UniqueFd>
      descriptors;  // the control segment and the wake socket, when the Welcome names a control channel
};
ProvenPeer hello_and_prove(zmq::socket_t& socket, const proto::Envelope& hello);
// Sends a set-up message on the link (with `descriptor` when >= 0); returns the answer over ZeroMQ.
proto::Envelope setup_exchange(zmq::socket_t& socket, int link, const proto::Envelope& envelope, int descriptor = -1);
// The calls one forward of the client's whole model makes: one per layer, one per [Layer groups]
// group instead of its members (a pass with gradients: no [MLP blocks]).
size_t forward_calls(const Client& client);
std::string binary(const std::string& relative);  // a path under the build directory
// Runs a shell command line; returns its exit status (-1 when it did not exit).
int shell(const std::string& command);
// One fp32 tensor of a safetensors file (a Python reference's output, which has no config.json).
at::Tensor read_safetensors_f32(const std::filesystem::path& file, const std::string& name);
// Spawns a program with arguments (stdout and stderr inherited); returns its pid.
pid_t spawn(const std::vector<std::string>& args);
// Waits for a spawned program; true when it exited 0.
bool exited_ok(pid_t pid);
// A small Llama-named checkpoint written by hand in a new temporary directory: the base layers
// model.layers.0.self_attn.q_proj ([8, 4], no bias) and model.layers.0.mlp.up_proj ([6, 4], with a
// bias), beside tensors that are not base layers (the embeddings; with `with_norms_and_head` the
// norms and the LM head too, which the executor then also serves). Drawn from `seed`.
struct TwoLayerCheckpoint {
  std::filesystem::path dir;
  at::Tensor q, up_weight, up_bias;
};
TwoLayerCheckpoint write_two_layer_checkpoint(const std::string& prefix, uint64_t seed, bool with_norms_and_head);
// Waits (up to 10 s) until the executor counts `n` same-host clients (it notices dead ones within
// ~200 ms).
bool same_host_clients_become(const Executor& executor, uint64_t n);
// [Executor restart] (client_runtime/client.cpp): an executor process serving `model` (with `args`
// after --model and --listen), that can be stopped or killed and started again on its endpoint.
class ExecutorProcess {
 public:
  explicit ExecutorProcess(const std::filesystem::path& model, std::vector<std::string> args = {"--device", "cpu"});
  ~ExecutorProcess();
  ExecutorProcess(const ExecutorProcess&) = delete;
  ExecutorProcess& operator=(const ExecutorProcess&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  // Sends `signal` and waits for the process to end.
  void end(int signal);
  // Ends it with `signal` and, `pause` later, starts it again serving `model`, in a thread: the
  // caller's next call finds it gone and waits for it.
  void restart(int signal, const std::filesystem::path& model,
               std::chrono::milliseconds pause = std::chrono::milliseconds(300));
  void wait_started();  // until the restart's start is done

 private:
  void start(const std::filesystem::path& model, const std::string& listen);

  std::vector<std::string> args_;
  std::filesystem::path logs_;
  pid_t pid_ = 0;
  std::string endpoint_;
  int starts_ = 0;
  std::thread restarting_;
};

// Polls `ready` every few milliseconds until it holds (true) or `limit` has passed (false): every
// test that waits on another process or thread has a deadline.
bool wait_until(const std::function<bool()>& ready, std::chrono::milliseconds limit);

}  // namespace symbiosis::testing
