#pragma once
// The ZeroMQ TCP transport's wire form: one Envelope frame, then a tensor's payload in raw frames of
// at most kPayloadFrameBytes each ([Bounded frames]). Tensors go out without copies: a frame
// borrows its part of the tensor's memory until ZeroMQ has sent it; a payload received in one frame
// becomes a tensor that owns the frame, one in several is gathered into a tensor of its own.
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <zmq.hpp>

#include "common/layer_info.h"
#include "common/status.h"
#include "symbiosis.pb.h"
#include "transport/call_ring.h"

namespace symbiosis::wire {

constexpr uint32_t kProtocolVersion = 8;  // 2: captured calls (slots in the control segment); 3: layer groups;
                                          // 4: proven placement (ProveHost, the local link);
                                          // 5: wake sockets in place of the doorbell, sealed segments;
                                          // 6: payloads in bounded frames; 7: voided runs (a word of
                                          // the control segment); 8: device words (the
                                          // control segment offers them)

// [Bounded frames]
// ZeroMQ holds a frame whole before anyone reads it, and it decodes a CURVE peer's handshake
// commands under the same per-frame limit (ZMQ_MAXMSGSIZE) as the messages that come after. So
// the executor's frame limit is what a stranger, whose key is refused only at the handshake's
// last step, can make it hold per connection. Payloads therefore travel in frames of at most
// kPayloadFrameBytes, and the executor reads no frame larger than that plus room for a header
// (ExecutorOptions::message_limit): a request of any size within --max-request-bytes passes, and a
// hand-made peer's huge handshake command is cut off at the limit.
constexpr size_t kPayloadFrameBytes = size_t{1} << 20;

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
// Throws (TORCH_CHECK) unless `endpoint` is a ZeroMQ endpoint of the form tcp://HOST:PORT or
// ipc://PATH (inproc://NAME too with allow_inproc); the message starts with `what` (the option or
// role, e.g. "client option endpoint") and names the value and the expected form. A bare
// "127.0.0.1:5555" would otherwise fail late or, worse, wait for an answer that never comes.
void validate_endpoint(const std::string& endpoint, const std::string& what, bool allow_inproc = false);
// The header of the call a Request carries, as the executor queues it; its shape travels beside
// it. Unchecked: [Call check] (base_executor/call_check.h) checks it.
shm::CallHeader call_header(const proto::Request& request);

// t's bytes as frames of at most kPayloadFrameBytes that borrow its memory (t is kept alive until
// ZeroMQ is done with each); one frame for an empty tensor. t must be contiguous, on the CPU.
std::vector<zmq::message_t> tensor_frames(const at::Tensor& t);
// The payload in `frames` as a tensor: over the bytes of a lone frame (owned by the tensor), or
// gathered into a new one from several frames or a misaligned one. The frames' sizes must sum
// to the shape's bytes (the caller checked).
at::Tensor frames_to_tensor(std::vector<zmq::message_t>&& frames, at::ScalarType dtype, at::IntArrayRef shape);
// The bytes of `frames` together.
size_t frame_bytes(const std::vector<zmq::message_t>& frames);

// Receives every frame of one multipart message (non-blocking caller must have polled first).
std::vector<zmq::message_t> recv_all(zmq::socket_t& socket);

}  // namespace symbiosis::wire
