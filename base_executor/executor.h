#pragma once
// The base executor: serves one checkpoint's base layers to many clients. start() loads the layers
// and begins serving; shutdown() stops. Inside ([Executor threads] in executor.cpp), a FrontDoor
// thread owns the ZeroMQ socket, the handshake and the client registry, and a Scheduler thread owns
// the Batcher and every client's Channel ([Transports] in transport/transport.h) and computes;
// every call passes one check (call_check.h) and runs through one batch data path
// (batch_runner.h), whichever transport brought it.
// The executor keeps no per-request state beyond bounded queues: a client that disappears
// leaves nothing behind. Thread safety: all public methods may be called from any thread.
#include <ATen/ATen.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "base_executor/base_model.h"
#include "base_executor/batching.h"
#include "base_executor/parts.h"
#include "base_executor/run_gathering.h"

namespace symbiosis {

// [Input observer]
// A hook for tests and auditing in the executor's own process (it has no flag): it is called on the
// scheduler's thread with each call's input as the executor received it, before it is packed into
// its batch, whatever transport brought it: the batch's number (counted from 1; calls observed
// with one number run as one batch), the calling client's id, the layer (or [Layer groups] group)
// called, the op, and the rows ([tokens, features], in the layer's dtype, on the executor's device,
// ready to read on the current stream). The rows are the transport's, valid only during the call:
// clone what you keep. Every batch waits for it, and an exception from it fails the batch's calls.
// A private tenant's tests read what the executor is really sent through it ([Noise masking] in
// privacy/noise_mask.h).
using InputObserver = std::function<void(uint64_t batch, uint64_t client_id, const LayerInfo& layer, LayerOp op,
                                         const at::Tensor& input)>;

struct ExecutorOptions {
  std::filesystem::path model_dir;               // Hugging Face checkpoint directory (required)
  std::string listen = "tcp://127.0.0.1:5555";   // ZeroMQ endpoint; port "*" picks a free one
  std::string device = "cpu";                    // "cpu" or "cuda:N"
  std::optional<at::ScalarType> dtype;           // compute dtype; default: the checkpoint's
  BaseLayerRule layers;                          // which tensors are base layers
  size_t max_request_bytes = size_t{256} << 20;  // larger payloads are refused
  // [Overload] (docs/operating.md): what one peer, or all of them, may make the executor hold. Past a
  // limit the peer is refused with RESOURCE_EXHAUSTED naming the limit and its flag; the others go on.
  // The largest ZeroMQ frame the executor reads (ZMQ_MAXMSGSIZE): a peer that sends a larger one,
  // handshake commands included, is disconnected before it is read ([Bounded frames] in
  // transport/zmq_wire.h). 0: a payload frame (1 MiB) and 64 KiB for a header.
  size_t max_message_bytes = 0;
  // ZeroMQ messages queued for one peer each way (the ROUTER's ZMQ_SNDHWM and ZMQ_RCVHWM). Replies
  // to a peer that does not read them past this many are dropped (the ROUTER's way; the peer stays
  // connected and its calls time out), so a peer that never reads holds at most this many replies.
  int max_queued_messages = 32;
  // Clients connected at once; a Hello past it is refused.
  size_t max_clients = 1024;
  // ZeroMQ connections in handshake at once (accepted, no message read yet): past it the oldest is
  // cut ([Connections in handshake] in connections.cpp). Each may hold up to a frame (message_limit).
  size_t max_handshakes = 256;
  // Tokens of the calls waiting to be batched (the scheduler's queue and the calls on their way to
  // it), shared fairly ([Fair shares] in overload.h): a client alone may use it all; under
  // contention a call past it is refused only when its client holds more than its share, and the
  // client runtime sends it again after a pause ([Back-pressure] in client_runtime/client.cpp). A
  // client with nothing queued may queue one call of any size (bounded by max_request_bytes). The
  // default lets 64 clients each keep a 4096-token call waiting (16 batches of --max-batch-tokens').
  int64_t max_queued_tokens = 262144;
  // [Buffer budget] (overload.h): bytes of shared memory held for clients: each same-host client's
  // control segment and the payload buffers clients register (RegisterBuffer, shm and cuda-ipc),
  // payload buffers shared fairly as queued tokens are. A handshake or registration past it is refused.
  uint64_t max_buffer_bytes = uint64_t{16} << 30;

  // max_message_bytes as it applies (its default resolved).
  size_t message_limit() const;
  BatchingOptions batching;  // see [Opportunistic batching]
  // CPU threads of each GEMM on a CPU device; 0: each batch's, sized from its work, up to the
  // cores LibTorch would use ([CPU threads] in cpu_threads.h).
  int threads = 0;
  int stats_interval_seconds = 0;  // log statistics this often; 0: never
  // Same-host clients: how long the scheduler thread spins for new work before sleeping on its
  // wake sockets (see [Wake sockets] in transport/call_ring.h); -1: 1000 on a GPU, 50 on CPU.
  int spin_us = -1;
  // A GPU executor computes on this many CUDA streams: a same-GPU request computed alone, in
  // place, on its client's; every other batch on the first (see [Compute streams] in common/cuda.h).
  // 1: every batch on one stream.
  int streams = 8;
  // [Calls by themselves] (gpu_share.h): a GPU executor's request of at least this many tokens whose
  // rows are on its GPU runs alone, at once: a same-GPU (CUDA IPC) one on its client's stream, beside
  // other clients' GEMMs (with more than one stream), an NCCL one on the first stream. At this size
  // that is faster than packing them (measured in docs/benchmarks-history.md). 0: such requests
  // batch as others.
  int64_t concurrent_tokens = 128;
  // [Fine-tuning's SMs] (kernels/direct_gemm.h): while a tenant decodes (a decode call in the last
  // 50 ms), a GPU executor sizes the GEMMs of batches of fine-tuning calls alone for this percent of
  // the GPU's multiprocessors, so that decode calls find the others free at once; 100: all of them.
  int finetune_sm_percent = 50;
  // [Fine-tuning in pieces] (base_executor/batch_runner.h): while a tenant decodes, a fine-tuning
  // call of more rows runs as GEMMs of at most this many rows, on a high-priority stream as decode
  // calls' are, so that a decode call waits behind one piece and fine-tuning is not left the GPU's
  // gaps. 0: whole, on a normal-priority stream.
  int finetune_piece_rows = 0;
  // [Steps launched ahead] (transport/cuda_ipc/cuda_ipc_channel.cpp): a same-GPU tenant's captured
  // decode steps, once seen, run as one launch each, their calls waiting on the GPU for their inputs.
  bool launch_ahead = true;
  // [Runs launched together] (base_executor/run_gathering.h): under opportunistic, such steps of
  // several tenants, ready at once, are one launch whose calls are one GEMM each; a ready step waits
  // up to launch_together_wait for the other tenants decoding, while at least launch_together_from
  // tenants of one model and size decode (it pays with many only: on an H200, 1.06x the steps
  // launched alone at 8 tenants, 1.04x at 16, 1.00x at 4, 0.93x at 2).
  bool launch_together = true;
  std::chrono::microseconds launch_together_wait{1000};
  size_t launch_together_max = kMaxRunsTogether;  // tenants' steps in one launch at most
  size_t launch_together_from = 8;                // tenants of one model decoding, at least, to go together
  // [Admission] (base_executor/admission.h, docs/operating.md): the keys folder. With it, traffic is
  // encrypted and only the tenants listed there are served. Without it the executor listens on
  // loopback only, unless `insecure` says to listen elsewhere anyway.
  std::filesystem::path keys_dir;
  bool insecure = false;
  // [Metrics] (metrics.h): where to serve Prometheus text over HTTP, "HOST:PORT" (port 0 picks a
  // free one); empty (the default): no metrics endpoint. It has no authentication: it must be a
  // loopback address unless `insecure`.
  std::string metrics_listen;
  // [Input observer]; empty (the default): nothing is observed, at no cost.
  InputObserver on_input;
  // [Parts] (parts.h): this executor as one part of a sharded executor; by default not sharded.
  PartOptions parts;

  // Throws naming the field when an option is out of range.
  void validate() const;
};

struct ExecutorStats {
  uint64_t clients = 0;            // connected now
  uint64_t same_host_clients = 0;  // of which with a payload channel (shm, cuda-ipc, nccl; headers over ZeroMQ too)
  uint64_t requests = 0;           // answered with a result
  uint64_t errors = 0;             // answered with an error
  uint64_t tokens = 0;
  double compute_seconds = 0;
  uint64_t direct_calls = 0;      // calls whose input or result lay in a client's shared segment ([Direct operands])
  uint64_t concurrent_calls = 0;  // calls run alone on their client's compute stream ([Compute streams])
  uint64_t replayed_calls = 0;    // captured calls whose GEMM was launched as a graph ([Replayed calls])
  uint64_t ahead_calls = 0;       // of those, launched ahead of their inputs ([Steps launched ahead])
  uint64_t buffer_bytes = 0;      // shared memory held for clients now ([Buffer budget] in overload.h)
  uint64_t weight_bytes = 0;      // of the base layers held here (a part's share: [Parts] in parts.h)
};

class Executor {
 public:
  static std::unique_ptr<Executor> start(const ExecutorOptions& options);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  std::string endpoint() const;  // the endpoint actually bound (with the chosen port)
  // [Metrics]: "http://HOST:PORT/metrics" as bound (with the chosen port); "" without --metrics-listen.
  std::string metrics_url() const;
  const BaseModel& model() const;
  ExecutorStats stats() const;
  // Idempotent; joins the threads. Clients hear why it stops: `reason` ("it was stopped"), or the
  // [Lost part]'s.
  void shutdown();
  void wait();  // blocks until shutdown() has run
  // [Lost part] (parts.h): why this part of a sharded executor can serve no more, once it cannot
  // (it refuses every call meanwhile: shut it down); empty while it serves.
  std::optional<Status> lost() const;

  class Impl;

 private:
  explicit Executor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace symbiosis
