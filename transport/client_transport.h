#pragma once
// The client's end of a transport ([Transports] in transport/transport.h): how a Client moves
// one call's tensors. The Client handshakes over its ControlSocket (transport/control_socket.h), and the executor's Welcome
// names the transport; the Client then makes that transport's ClientTransport
// (plugin(kind).make_client) and sends every base-layer call through it.
//  - tcp (transport/tcp/): header and payload in ZeroMQ frames on the control socket (any host,
//    CPU or GPU tensors staged through host memory).
//  - shm, cuda-ipc, nccl: headers through the shared-memory control channel on the executor's
//    host ([Shared-memory control channel] in transport/call_ring.h), or as ZeroMQ Requests without
//    a payload frame (from another host, or with ClientOptions::control "zmq"); payloads through
//    the transport's ClientPayload (transport/client_payload.h).
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/layer_info.h"
#include "symbiosis.pb.h"
#include "transport/call_ring.h"
#include "transport/control_socket.h"
#include "transport/transport.h"

namespace symbiosis {

struct CallSpec {
  const LayerInfo* layer;
  proto::Op op;
  uint64_t request_id;
  proto::LatencyClass latency_class;
  int64_t out_features;  // of the result
};

// [Captured calls] (transport/call_ring.h): the headers of the calls a captured step made, in
// order, each with its slot; pushed again, renumbered, at every replay.
struct CapturedCalls {
  std::vector<shm::CallRecord> records;
  // What else the client does once a replay's calls are sent (the noise mask's count of the calls:
  // [Masked captures] in privacy/noise_mask.h); may be empty.
  std::function<void()> after_replay;
  // [Executor restart]: the client's connection they were recorded on (counted from 1); a replay
  // after a reconnection would signal slots that are not there any more.
  uint64_t connection = 0;
};

class ClientTransport {
 public:
  virtual ~ClientTransport() = default;
  // x: [tokens, features] contiguous, in the layer's dtype. Returns [tokens, out_features] on x's
  // device. Throws the executor's error, or a timeout naming the executor.
  virtual at::Tensor call(const CallSpec& spec, const at::Tensor& x) = 0;
  // Waits until every call made so far has its result and throws the first error among them
  // (calls ordered on the GPU return before the executor has answered: [Stream-ordered hand-off]).
  virtual void settle() {}
  // [Captured calls]: from begin_capture() to end_capture(), call() records each call (its header,
  // and on the current stream the slot's flag operations) instead of sending it; the current
  // stream is being captured into a CUDA graph. Only a transport that orders its calls on the GPU
  // through the control segment, with the operands where they lie, can; others throw naming why.
  virtual void begin_capture();
  virtual std::shared_ptr<const CapturedCalls> end_capture() { return nullptr; }
  // Whether begin_capture() would start a capture (rather than throw why not).
  virtual bool can_capture() const { return false; }
  // Pushes a replay's headers, numbered from first_request_id; call it right after launching the
  // replay of the graph that recorded them.
  virtual void replay(const CapturedCalls&, uint64_t /*first_request_id*/) {}
  // [Executor restart]: whether calls that returned before the connection was lost wait for
  // results that will never come (calls ordered on the GPU: [Stream-ordered hand-off]).
  virtual bool results_lost() const { return false; }
};

// A call's Request header (its payload, if any, follows in a frame of its own).
proto::Envelope request_envelope(const CallSpec& spec, const at::Tensor& x);
// The executor's Reply to this call over ZeroMQ, its frames in `frames`; skips late answers to
// calls that timed out.
proto::Reply await_reply(ControlSocket& socket, const CallSpec& spec, std::vector<zmq::message_t>& frames);

// Where this process runs, for the Hello.
proto::Placement local_placement(const std::string& device);

}  // namespace symbiosis
