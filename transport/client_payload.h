#pragma once
// The client's end of a transport whose headers go through the control channel (shm, cuda-ipc,
// nccl; see transport/client_transport.h): a ClientPayload moves one call's input to the executor
// and its result back; the control channel carries the header in between.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include <algorithm>
#include <functional>
#include <mutex>

#include "symbiosis.pb.h"
#include "transport/client_transport.h"
#include "transport/transport.h"

namespace symbiosis {
namespace shm {
class SharedMemory;
struct CallHeader;
}  // namespace shm

class ClientPayload {
 public:
  virtual ~ClientPayload() = default;
  // Makes room for a call of `bytes` (input and output regions), registering a larger buffer with
  // the executor first when needed.
  virtual void reserve(uint64_t bytes) = 0;
  // Which registration the call's offsets refer to.
  virtual uint64_t generation() const = 0;
  // Makes x (contiguous, the layer's dtype) available to the executor at `offset`.
  virtual void send_input(const at::Tensor& x, uint64_t offset) = 0;
  // The result at `offset`, once the executor's reply said OK, as a tensor of its own on `device`.
  virtual at::Tensor receive_output(uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape,
                                    at::Device device) = 0;
  // The executor answered with an error: no result will come.
  virtual void abandon_output() {}
  // Whether a call of `bytes` fits the buffer registered now.
  virtual bool fits(uint64_t) const { return true; }

  // [Stream-ordered hand-off] (transport/call_ring.h). Whether this payload can order calls through
  // the flags of the control segment `control` (which it then pins for its GPU); if so, each call
  // goes place_direct, or else send_input; then announce_input, await_result, and (after
  // send_input) receive_output; nothing waits on the host.
  virtual bool order_through(shm::SharedMemory&) { return false; }
  // Right after place_direct or send_input, on its stream: the GPU writes `sequence` into
  // inputs_ready once the input is written ...
  virtual void announce_input(uint32_t) {}
  // ... and holds later work until results_ready reaches `sequence`.
  virtual void await_result(uint32_t) {}
  // Before a capture begins, on the stream to be captured: orders that stream after this payload's
  // earlier calls now, since a capture cannot wait on work outside it ([Capture's stream]).
  virtual void before_capture() {}
  // [Captured calls] (transport/call_ring.h), instead of those two, on the stream being captured:
  // sets slot `slot`'s input flag, waits for its result flag and clears it.
  virtual void announce_captured(uint32_t) {}
  // A replay pushed calls up to `sequence`: what announce_input says of the calls it numbers.
  virtual void replayed(uint32_t) {}
  // [Direct operands], for a call ordered through the flags: when the executor can read x where it
  // lies and write the result into a tensor of the client's own, names both in h (segments and
  // offsets) and returns that tensor (written once await_result's wait is passed); otherwise an
  // undefined tensor, and the call goes through the buffer.
  virtual at::Tensor place_direct(const at::Tensor&, int64_t /*out_features*/, shm::CallHeader&) { return {}; }
};

// The ClientTransport of a payload transport: calls through the payload make_payload makes,
// headers through the control segment the Welcome names, or over ZeroMQ when it names none. The
// payload is made once the control segment is mapped: its set-up (NCCL's) lets the executor
// unlink the segment's name.
std::unique_ptr<ClientTransport> make_payload_transport(
    ControlSocket& socket, const proto::Welcome& welcome, const ClientEndOptions& options,
    const std::function<std::unique_ptr<ClientPayload>()>& make_payload);

// [Registered buffers] (transport/channel.h): a payload buffer registered with the executor (shm,
// cuda-ipc). It grows by registering a new, larger buffer (the old one is released only after the
// executor has let go of it).
constexpr uint64_t kInitialBufferBytes = uint64_t{4} << 20;

class RegisteredBuffer : public ClientPayload {
 public:
  explicit RegisteredBuffer(ControlSocket& socket) : socket_(socket) {}

  void reserve(uint64_t bytes) override {
    if (bytes <= capacity_) return;
    uint64_t size = std::max<uint64_t>(kInitialBufferBytes, capacity_ * 2);
    while (size < bytes) size *= 2;
    allocate(size);
    proto::Envelope env;
    auto* r = env.mutable_register_buffer();
    r->set_generation(generation_ + 1);
    r->set_bytes(size);
    const int segment = describe(r);
    std::unique_lock<std::mutex> lock(socket_mutex_);
    auto answer = socket_.exchange_setup(env, "the payload buffer registration", segment);
    lock.unlock();
    TORCH_CHECK(answer.has_buffer_registered() && answer.buffer_registered().generation() == generation_ + 1,
                "executor answered a buffer registration with something else");
    registered(answer.buffer_registered());
    capacity_ = size;
    generation_++;
  }

  uint64_t generation() const override { return generation_; }
  bool fits(uint64_t bytes) const override { return bytes <= capacity_; }

 protected:
  // Makes a new buffer of `bytes` the current one (the previous stays alive until registered()).
  virtual void allocate(uint64_t bytes) = 0;
  // Fills in what the executor needs to map it; returns the descriptor to hand over with it, or -1.
  virtual int describe(proto::RegisterBuffer* registration) = 0;
  // The executor has mapped the new buffer and released the old one.
  virtual void registered(const proto::BufferRegistered& answer) = 0;

  ControlSocket& socket_;
  // Held around every exchange on socket_ but for the handshake's: a segment's release
  // ([Direct operands]) may come from any thread that frees memory.
  std::mutex socket_mutex_;

 private:
  uint64_t capacity_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace symbiosis
