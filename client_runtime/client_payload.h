#pragma once
// Internal to the client runtime: where a same-host call's tensors travel (see client_transport.h).
// A ClientPayload moves one call's input to the executor and its result back; the control
// channel carries the header in between.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "client_runtime/client.h"

namespace symbiosis {
namespace shm {
class SharedMemory;
struct CallHeader;
}

class ControlSocket;

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

// The "nccl" payload (nccl_payload.cpp), made by make_client_payload.
std::unique_ptr<ClientPayload> make_nccl_payload(const ClientOptions& options, ControlSocket& socket);

// kind: "shm" (host shared memory), "cuda-ipc" (a device buffer shared through CUDA IPC) or "nccl".
std::unique_ptr<ClientPayload> make_client_payload(const std::string& kind, const ClientOptions& options,
                                                   ControlSocket& socket);

}  // namespace symbiosis
