#pragma once
// A tenant's connection to a base executor. connect() handshakes, checks the model hash and
// fetches the layer table; forward()/backward_input() run one base layer on the executor.
// Executor errors are thrown as c10::Error carrying the executor's message. A client that loses its
// executor connects again and retries the call ([Executor restart] in client.cpp).
// The transport follows the placement unless options.transport names one: a client on the
// executor's host uses the shared-memory control channel, with payloads in host shared memory
// (CPU clients, "shm"), in a device buffer shared through CUDA IPC (clients on the executor's GPU,
// "cuda-ipc") or over NCCL (clients on another GPU, "nccl"); a client on another host uses TCP,
// or NCCL when it asks for it (headers then go over ZeroMQ; see ClientOptions::control).
// Thread safety: calls are serialized internally; one Client may serve several threads.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/layer_info.h"
#include "privacy/noise_mask.h"
#include "virt_layer/layer_backend.h"

namespace symbiosis {

struct ClientOptions {
  std::string endpoint = "tcp://127.0.0.1:5555";  // the executor's --listen endpoint: tcp://HOST:PORT or ipc://PATH
  std::string tenant = "default";                 // who this client is, for the executor's logs
  std::string expected_model_hash;                // refuse an executor serving another model; "" accepts any
  int timeout_ms = 60000;                         // per call; the executor must answer within this
  // connect(): how long to wait for the executor's answer to the handshake. The client logs what it
  // waits for every 2 s, and gives up after 2 s where nothing listens at the endpoint (connections
  // refused), whatever this says ([No silent waits] in transport/control_socket.cpp).
  int connect_timeout_ms = 10000;
  // [Executor restart]: how long a client that lost its executor (stopped, crashed, restarting)
  // tries to connect again, with back-off, before its call fails saying so; 0: it does not try.
  int reconnect_ms = 60000;
  LatencyClass latency_class = LatencyClass::kFineTuning;
  // [Decode halves] (inference/generator.h): which of the tenant's decode lanes this connection
  // carries (the Generator's second half's: 1); runs of different lanes never launch together.
  uint32_t lane = 0;
  // Where this client's tensors live: "cpu" or "cuda:N". Decides the transport with "auto".
  std::string device = "cpu";
  // "auto" (the executor picks by placement), "tcp", "shm", "cuda-ipc" or "nccl".
  std::string transport = "auto";
  // Same-host transports: how long to spin for a reply before sleeping (see [Spin, then sleep]);
  // -1: 1000 us for a client on a GPU, 50 on CPU.
  int spin_us = -1;
  // Where call headers go when the payload does not travel in ZeroMQ frames (shm, cuda-ipc,
  // nccl): "auto" (the shared-memory control channel on the executor's host, ZeroMQ from another
  // host, as an nccl client on another host needs) or "zmq" (ZeroMQ in any case, e.g. where the
  // client cannot share /dev/shm with the executor).
  std::string control = "auto";
  // cuda-ipc with headers through the control segment: a call's input and result stay in this
  // client's own tensors, which the executor reads and writes where they lie ([Direct operands]
  // in transport/cuda_ipc/cuda_ipc_client.cpp). false: they are copied through the payload buffer.
  bool direct_operands = true;
  // [Admission keys] (docs/operating.md), for an executor started with --keys: its public key (the
  // executor.pub file, or the key's 40 Z85 characters) and this tenant's key pair (the NAME.key
  // file `symbiosis-ctl keygen NAME` wrote). Both empty: no keys (the traffic is not encrypted).
  std::string executor_key;
  std::string key_file;
  // [Noise masking] (privacy/noise_mask.h): this client's activations and gradients reach the
  // executor masked with noise only it knows. Off by default.
  PrivacyOptions privacy;

  void validate() const;  // throws naming the field
};

struct CapturedCalls;  // [Captured calls]: internal to the client runtime

// [Executor restart]: the executor was lost while calls ordered on the GPU still waited for their
// results ([Stream-ordered hand-off] in transport/call_ring.h), which are void. The client has
// reconnected: redo the work since the last settle() (the trainer redoes the step).
class ResultsLost : public c10::Error {
 public:
  using c10::Error::Error;
};
// Runs `step` (one step of the trainer or the generator, which updates nothing before its calls
// have their results) and runs it again when it throws ResultsLost, up to three times in all; then
// throws the last ResultsLost's message, naming `what`.
void redo_if_results_lost(const std::string& what, const std::function<void()>& step);

class Client : public LayerBackend {
 public:
  static std::shared_ptr<Client> connect(const ClientOptions& options);
  ~Client() override;
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  uint64_t client_id() const;
  const ClientOptions& options() const;  // as connect() was given them
  // Whether `other` was given the same layer table (layers, groups, their ids) as this client, as
  // a reconnection is checked to be.
  bool same_layer_table(const Client& other) const;
  const std::string& model_hash() const;
  // [Noise masking]: the client's mask, or nullptr when it does not mask (rotate() draws new banks).
  const NoiseMask* noise_mask() const;
  NoiseMask* noise_mask();
  const std::vector<LayerInfo>& layers() const;
  // The layer named so (checkpoint name without ".weight"), or nullptr.
  const LayerInfo* find_layer(const std::string& name) const;
  // [Layer groups] (base_executor/base_model.h): the groups the executor serves beside its layers,
  // and its [MLP blocks] after them.
  const std::vector<LayerInfo>& groups() const;
  const LayerInfo* group(const std::vector<uint32_t>& members, const std::string& activation) const override;

  at::Tensor forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) override;
  at::Tensor backward_input(const LayerInfo& layer, const at::Tensor& grad_out) override;

  // Waits until every base-layer call made so far has its result, and throws the first executor
  // error among them. A same-GPU client's calls return before the executor has answered them
  // ([Stream-ordered hand-off] in transport/call_ring.h), so an error reaches it at its next call or
  // here: settle before an optimizer step, so that a failed call never updates the adapters.
  void settle();

  // [Captured steps] (client_runtime/training/step_graph.h; StepGraph calls these). While the current CUDA
  // stream is captured into a graph, begin_capture() makes this client record its calls instead of
  // sending them, and end_capture() returns them; replay() sends one replay's calls, right after
  // that replay of the graph is launched. Only a client on the executor's GPU whose calls go
  // through the shared-memory control channel with direct operands (the default there) can be
  // captured: others throw, naming why. A masked client's calls are masked anew at each replay
  // ([Masked captures] in privacy/noise_mask.h).
  void begin_capture();
  std::shared_ptr<const CapturedCalls> end_capture();
  // Whether begin_capture() would start a capture on the present connection (rather than throw why
  // not); StepGraph runs the steps of a client that cannot eagerly.
  bool can_capture() const;
  void replay(const CapturedCalls& calls);
  // [Executor restart]: whether `calls` were captured on the present connection (replay() throws
  // otherwise: the executor restarted since, and the step is to be captured again).
  bool replayable(const CapturedCalls& calls) const;

  void set_latency_class(LatencyClass latency_class);
  LatencyClass latency_class() const;  // the class this client's calls carry now
  uint64_t calls() const;  // base-layer calls sent so far (a capture's calls count as its replays send them)
  // [Executor restart]: connections made to the executor, the first counted; a capture made on an
  // earlier one cannot be replayed (StepGraph captures its step again).
  uint64_t connection() const;
  const std::string& transport() const;  // the transport in use: tcp, shm, cuda-ipc or nccl

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace symbiosis
