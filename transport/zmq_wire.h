#pragma once
// The ZeroMQ TCP transport's wire form: one Envelope frame, then raw tensor payload frames.
// Tensors travel by value without copies: a frame borrows the tensor's memory until ZeroMQ has
// sent it, and a received frame becomes a tensor that owns the frame.
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <zmq.hpp>

#include "common/status.h"
#include "symbiosis.pb.h"
#include "transport/call_ring.h"
#include "virt_layer/layer_info.h"

namespace symbiosis::wire {

constexpr uint32_t kProtocolVersion = 5;  // 2: captured calls (slots in the control segment); 3: layer groups;
                                          // 4: proven placement (ProveHost, the local link);
                                          // 5: wake sockets in place of the doorbell, sealed segments

proto::DType to_proto(at::ScalarType dtype);
// Throws naming the value when the dtype is not one this project carries.
at::ScalarType from_proto(proto::DType dtype);
proto::LayerInfo to_proto(const LayerInfo& info);
LayerInfo from_proto(const proto::LayerInfo& info);
std::string op_name(proto::Op op);

zmq::message_t serialize(const proto::Envelope& envelope);
// [Error model] (common/status.h): the one place a Status code becomes the wire's.
proto::ErrorCode to_proto(StatusCode code);
proto::LatencyClass to_proto(LatencyClass latency);
// A header's latency class; any value but decode and prefill (a peer's too) reads as fine-tuning.
LatencyClass latency_from_proto(int32_t latency);
// An error for a ZeroMQ client: as the reply to one request, or on its own (handshake, set-up).
proto::Envelope error_envelope(uint64_t request_id, const Status& status, bool as_reply);
// Sends `envelope` to the peer `identity` names: through a ROUTER, or a socket that forwards to one;
// then the payload frames, if any.
void send_to(zmq::socket_t& socket, std::string_view identity, const proto::Envelope& envelope);
void send_to(zmq::socket_t& socket, std::string_view identity, const proto::Envelope& envelope,
             std::vector<zmq::message_t>& payload);
bool parse(const zmq::message_t& frame, proto::Envelope* envelope);
// Why `endpoint` is not a ZeroMQ endpoint of the form tcp://HOST:PORT or ipc://PATH (inproc://NAME
// too with allow_inproc), naming the value and the expected form; "" when it is one. A bare
// "127.0.0.1:5555" would otherwise fail late or, worse, wait for an answer that never comes.
std::string endpoint_problem(const std::string& endpoint, bool allow_inproc = false);
// The header of the call a Request carries, as the executor queues it; its shape travels beside
// it. Unchecked: [Call check] (base_executor/call_check.h) checks it.
shm::CallHeader call_header(const proto::Request& request);

// A frame that borrows t's memory (t is kept alive until ZeroMQ is done). t must be contiguous, CPU.
zmq::message_t tensor_frame(const at::Tensor& t);
// A tensor over the frame's bytes (owned by the tensor), or a copy if they are misaligned.
at::Tensor frame_to_tensor(zmq::message_t&& frame, at::ScalarType dtype, at::IntArrayRef shape);

// Receives every frame of one multipart message (non-blocking caller must have polled first).
std::vector<zmq::message_t> recv_all(zmq::socket_t& socket);

}  // namespace symbiosis::wire
