#pragma once
// The executor's end of one client's transport ([Transports] in transport/transport.h). A channel
// owns the executor's side of the client's payload: its ZeroMQ frames (tcp), a host shared-memory
// segment (shm), a CUDA IPC mapping of the client's GPU memory with the control segment's flags or
// two interprocess events (cuda-ipc), or a 2-rank NCCL communicator (nccl); and the client's
// control: its control segment ([Shared-memory control channel] in transport/call_ring.h) on this
// host, or ZeroMQ (control_over_zmq) for tcp, for a client on another host (nccl) or one that
// asked for it: headers come as Requests and replies go back as Replies.
//
// Threads: the executor's front door creates a channel at the handshake; from then on only the
// scheduler's thread touches it (it polls the request ring, registers buffers, reads inputs,
// writes results, replies). A channel is kept alive by the work that refers to it, so a client
// that leaves while its requests are queued leaves nothing half-released: the mapping closes after
// the last use.
#include <ATen/ATen.h>

#include <atomic>
#include <deque>
#include <memory>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <zmq.hpp>

#include "common/status.h"
#include "common/unique_fd.h"
#include "symbiosis.pb.h"
#include "transport/call_ring.h"
#include "transport/transport.h"

namespace symbiosis {

class Channel;

// [Steps launched ahead]: what a channel needs of the executor to enqueue calls itself.
class CallEnqueuer {
 public:
  virtual ~CallEnqueuer() = default;
  // Enqueues call h's GEMM on LibTorch's current stream, from its input into its destination in
  // `channel`'s memory (h was checked when it was first taken).
  virtual void enqueue(Channel& channel, const shm::CallHeader& h) = 0;
  // [Runs launched together] (transport/cuda_ipc/cuda_ipc_channel.cpp): calls of the same layer and
  // op, one of each of several channels (each checked when first taken), as one GEMM on the current
  // stream: their inputs packed into rows of `scratch`, the GEMM, the result rows back to each
  // call's destination.
  virtual void enqueue_packed(const std::vector<std::pair<Channel*, shm::CallHeader>>& calls,
                              const at::Tensor& scratch) = 0;
  // Scratch for enqueue_packed of calls of `rows` rows in all: made now (never during a capture),
  // and used by one stream at a time.
  virtual at::Tensor packing_scratch(int64_t rows) = 0;
  // Computes a GEMM of its own on the current stream and waits for it, so that the GEMM library's
  // handle and workspace for the stream exist before any capture on it.
  virtual void warm_up_stream() = 0;
};

class Channel {
 public:
  // Made by a transport's plugin (plugin(kind).make_channel).
  virtual ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  TransportKind kind() const { return kind_; }
  const char* kind_name() const { return transport_name(kind_); }
  uint64_t client_id() const { return client_id_; }
  // The control segment's descriptor, to hand to the proven client ([Proven placement] in
  // transport/local_socket.h); -1 for a channel without one (tcp).
  int control_descriptor() const { return control_.mapped() ? control_.descriptor() : -1; }
  // [Wake sockets] (transport/call_ring.h): the client's end of its wake socket, to hand over with
  // the control segment (once; the channel keeps no copy); none for a channel without a segment.
  UniqueFd take_wake_writer();
  // [Link closed last]
  // A same-host client takes its local link's close for the executor lost: it connects again and
  // redoes its work since its last settle() ([Executor restart] in client_runtime/client.cpp). A
  // dropped client's channel may still have work on the GPU that writes the client's memory: a run
  // launched ahead that the watchdog released computes on whatever the client's tensors hold and
  // writes its results into them, and the channel's destructor waits for it (a cuda-ipc channel's
  // streams). So the front door, forgetting the client, hands its link to the channel, which
  // closes it only as it goes, after that wait: a late write can no longer land in the tensors of
  // the redo (V28: the steps redone after a drop gave other tokens).
  void close_link_when_gone(UniqueFd link) { link_ = std::move(link); }
  // Front door, at the handshake: headers come over ZeroMQ (the front door hands them to the scheduler
  // thread), and replies go to the client `identity` names through a socket of the channel's own
  // connected to the front door's `replies_endpoint`. The control segment is not used.
  void control_over_zmq(zmq::context_t& context, std::string replies_endpoint, std::string identity);
  bool zmq_control() const { return zmq_context_ != nullptr; }
  // Whether a call's payload comes in ZeroMQ frames after its header (tcp): the front door then
  // hands them to receive_frames.
  virtual bool payload_in_frames() const { return false; }

  // The scheduler's thread from here on.

  // tcp: keeps the payload frames that came with call `h`'s header, for check_payload and input
  // (and may note in `h` where it keeps them).
  virtual void receive_frames(shm::CallHeader& h, std::vector<zmq::message_t> frames);

  // Maps the buffer a RegisterBuffer names (releasing the previous one); `segment`: the descriptor
  // that came with it on the local socket ("shm"), if any. Throws naming the problem.
  virtual proto::BufferRegistered register_buffer(const proto::RegisterBuffer& registration, UniqueFd segment) = 0;
  // [Transport set-up]
  // A set-up message of the transport's own, beyond RegisterBuffer: the client's control envelope
  // whose body it is (ShareSegments for cuda-ipc, [Direct operands]; NcclSetup for nccl, whose
  // communicator it starts). The plug-in does its set-up and returns the answer, which the
  // executor sends once setup_done() (asked again until then). A transport that takes no such
  // message, or not this one, leaves it to the base, which refuses naming the message and the
  // channel's transport. Throws naming the problem. The wire messages stay in proto/; only the
  // plug-in reads its own.
  virtual proto::Envelope set_up(const proto::Envelope& message);
  // Whether the set-up that set_up started is finished (NCCL: the communicator has joined and
  // connected); never blocks; throws naming the problem when it failed.
  virtual bool setup_done() { return true; }
  // The oldest request header the client pushed whose input is ready to read, or nullopt. A call
  // numbered for the [Stream-ordered hand-off] (transport/call_ring.h) waits here until the
  // client's GPU has written its input, and the calls after it wait behind it. After a corrupt
  // ring, broken() is true (any thread may ask; the front door then forgets the client).
  std::optional<shm::CallHeader> next_request();
  // Whether the client has written the input of call `h` ([No waits on a client] in
  // transport/cuda_ipc/cuda_ipc_channel.cpp: asked from the host; never waits).
  bool input_written(const shm::CallHeader& h) const { return input_ready(h); }
  // Calls pushed but not yet handed out: their inputs are about to be written.
  bool waiting() const { return !waiting_.empty(); }
  // A corrupt ring, a reply ring that stays full, or shared memory that faulted ([Fault guard] in
  // transport/shared_memory.h).
  bool broken() const { return broken_ || faulted(); }
  bool faulted() const { return control_.faulted() || memory_faulted(); }
  // [Wake sockets]: whether the client claims requests the scheduler has not taken (next_request()
  // then looks); the executor's end, which the scheduler polls while it sleeps (-1: none);
  // telling the client that the scheduler sleeps.
  bool has_request() const;
  int wake_descriptor() const { return wake_ ? wake_->reader() : -1; }
  void executor_sleeps(bool sleeping);
  // The client closed its end: the scheduler polls this channel's socket no more.
  void stop_wakes() { wake_.reset(); }
  // Whether this transport answers a numbered call (sequence != 0) by its flag, not by a reply.
  virtual bool orders_by_flags() const { return false; }
  // Any thread: the payload's connection reports the client gone (NCCL to a peer that died).
  virtual bool failed() const { return false; }
  // Checks the call's payload against what the client registered or sent.
  virtual Status check_payload(const shm::CallHeader& h, uint64_t in_bytes, uint64_t out_bytes) const = 0;
  // The call's input, ready to read on the current stream (host memory, or the executor's GPU), or
  // an undefined tensor when it must be received into rows the executor gives instead (NCCL
  // receives it straight into the batch): receive_into writes it there, ready to read on the
  // current stream.
  virtual at::Tensor input(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) = 0;
  virtual void receive_into(const shm::CallHeader& h, const at::Tensor& rows);
  // Where the result goes, or an undefined tensor when it must be handed to deliver() instead.
  virtual at::Tensor destination(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) = 0;
  // Hands over a result that has no destination (NCCL sends it).
  virtual void deliver(const shm::CallHeader& h, const at::Tensor& rows);
  // [Replayed calls] (common/cuda.h): enqueues `compute` (the call's GEMM from `input` into
  // `destination`) on the current stream, for a captured call from a graph made at its first run
  // and made again when its operands or stream change; true then. False for any other call: the
  // caller runs `compute` itself. `variant` names what else decides what `compute` enqueues (the
  // GEMMs' share of the GPU, [Fine-tuning's SMs] in kernels/direct_gemm.h): a graph is kept for
  // each.
  virtual bool compute_replayed(const shm::CallHeader&, const at::Tensor& /*input*/, const at::Tensor& /*destination*/,
                                int /*variant*/, const std::function<void()>& /*compute*/) {
    return false;
  }
  // Whether the call is one whose operands lie at the same addresses at each of its client's steps
  // (a captured call), so that work recorded for it is worth keeping: [Replayed batches] in
  // base_executor/batch_runner.cpp.
  virtual bool recurs(const shm::CallHeader&) const { return false; }
  // After the call's result is enqueued: orders it before the client's read.
  virtual void finish_writes(const shm::CallHeader&) {}
  // The call was computed in a batch, alone or packed with other clients' calls, and its result is
  // being delivered ([Steps launched ahead] records runs from such calls).
  virtual void computed(const shm::CallHeader&) {}
  // [Steps launched ahead] (transport/cuda_ipc/cuda_ipc_channel.cpp): whether the client's next
  // calls repeat, whole, a run of captured calls it made before, so that launch_ahead would launch
  // them: the run's signature then (runs of one signature make the same calls of the same layers,
  // and may be launched together), nullopt otherwise; then next_request() hands the calls out one by
  // one. May drop the client (a run it left stalled).
  virtual std::optional<uint64_t> run_ready() { return std::nullopt; }
  // Enqueues the ready runs of `together` at once, each call waiting on the GPU for its input: this
  // channel's first, every channel of this transport with run_ready() of one signature, and the
  // calls of the same place in their runs one GEMM ([Runs launched together]). Returns each
  // channel's calls, handed out (next_request() goes on after them); empty ones where the launch
  // failed (the channel then goes call by call).
  virtual std::vector<std::vector<shm::CallHeader>> launch_ahead(const std::vector<Channel*>& together, CallEnqueuer&) {
    return std::vector<std::vector<shm::CallHeader>>(together.size());
  }
  // Pushes an OK reply and wakes the client; a transport that lets its client see the reply only
  // once the result is computed (NCCL, [NCCL readiness]) holds it until release_replies().
  void reply(const shm::CallHeader& h) {
    if (h.sequence != 0 && orders_by_flags()) return;  // its flag answers it
    if (!hold_reply(h)) push_reply(h, Status::ok());
  }
  // Pushes the held replies whose results are ready; true while one is still held.
  virtual bool release_replies() { return false; }
  // Answers the call with an error naming the problem. A transport whose payload cannot be left
  // half-exchanged (NCCL: the client's send or receive can never be matched now) is shut down.
  void refuse(const shm::CallHeader& h, const Status& status);

  // Any thread: the client is gone; release what could block on it (NCCL kernels waiting on a
  // dead peer). The scheduler drops the channel afterwards.
  virtual void abort() {}

 protected:
  // with_control_segment: whether the client may use the shared-memory control channel (every
  // transport but tcp); a channel whose headers come over ZeroMQ lets the segment go.
  Channel(TransportKind kind, uint64_t client_id, bool with_control_segment = true);
  // [Fault guard]: whether a touch of the client's payload memory faulted.
  virtual bool memory_faulted() const { return false; }
  // refuse() has answered: what the transport must do about the call's payload.
  virtual void after_refusal(const shm::CallHeader&) {}
  // Whether the client's GPU has written the input of call `h`.
  virtual bool input_ready(const shm::CallHeader&) const { return true; }
  // next_request() hands `h` out ([Captured calls]: clears its slot's input flag).
  virtual void taken(const shm::CallHeader&) {}
  // The calls the client pushed that are not handed out yet, oldest first (the ring read first);
  // hand_out(n) hands out the first n without taken().
  const std::deque<shm::CallHeader>& pending();
  void hand_out(size_t n);
  // The client broke the protocol in a way only the executor sees: it is dropped (broken()).
  void drop(const std::string& why);
  shm::SharedMemory& control_memory() { return control_; }
  shm::ControlBlock* control_block() const { return block_; }
  // reply() is about to answer: true when the transport keeps the reply for release_replies().
  virtual bool hold_reply(const shm::CallHeader&) { return false; }
  // Sends the answer to call `h`: through the reply ring, or over ZeroMQ (ok_reply fills in what
  // an OK Reply carries).
  void push_reply(const shm::CallHeader& h, const Status& status);
  // ZeroMQ control: adds to an OK reply's envelope and payload frames (tcp: the result).
  virtual void ok_reply(const shm::CallHeader&, proto::Reply&, std::vector<zmq::message_t>&) {}

 private:
  UniqueFd link_;  // [Link closed last]: first, so that it closes after everything else
  TransportKind kind_;
  uint64_t client_id_;
  shm::SharedMemory control_;
  shm::ControlBlock* block_ = nullptr;
  std::optional<shm::WakeSocket> wake_;  // [Wake sockets]: with the control segment
  uint64_t next_read_ = 0;
  std::atomic<bool> broken_{false};
  std::deque<shm::CallHeader> waiting_;    // calls taken from the ring, not yet handed out; oldest first
  zmq::context_t* zmq_context_ = nullptr;  // set by control_over_zmq
  std::string replies_endpoint_, identity_;
  std::unique_ptr<zmq::socket_t> replies_;  // made on the scheduler's thread at the first reply
};

// [Registered buffers] A channel whose payload lives in a buffer the client registered (shm,
// cuda-ipc): a call names offsets into it (or, [Direct operands], into a segment the client
// shared), inputs are read and results written there in place. Subclasses map the buffer.
class RegisteredBufferChannel : public Channel {
 public:
  using Channel::Channel;
  // The memory a call's offset refers to: the payload buffer (segment 0) or a shared segment.
  struct Region {
    const char* base = nullptr;  // nullptr: nothing is registered under that id
    uint64_t size = 0;
  };

  proto::BufferRegistered register_buffer(const proto::RegisterBuffer& r, UniqueFd segment) final;
  Status check_payload(const shm::CallHeader& h, uint64_t in_bytes, uint64_t out_bytes) const final;
  at::Tensor input(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) final;
  at::Tensor destination(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) final;

 protected:
  // Maps the buffer `r` names in place of the previous one (which then goes); may add to `answer`.
  virtual void map(const proto::RegisterBuffer& r, UniqueFd segment, proto::BufferRegistered* answer) = 0;
  virtual void* base() const = 0;
  virtual size_t size() const = 0;
  // [Direct operands]: a segment the client shared (id > 0), or an empty Region.
  virtual Region shared_segment(uint32_t) const { return {}; }
  virtual at::TensorOptions view_options() const = 0;

 private:
  Region region(uint32_t segment) const;
  at::Tensor view(Region region, uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape) const;
  uint64_t generation_ = 0;  // of the buffer mapped now
};

}  // namespace symbiosis
