// The executor's end of the "tcp" transport: a call's payload comes in the frames after its
// Request header, and its result goes back in frames after the Reply ([Bounded frames] in
// transport/zmq_wire.h). The channel keeps each
// call's frame from its arrival to its batch, and its result from the batch to the reply, under a
// number of its own that it writes into the call's in_offset and out_offset (a tcp call names no
// offsets otherwise), so a client that repeats a request id only confuses itself.
#include <c10/util/Exception.h>

#include <unordered_map>

#include "transport/channel.h"
#include "transport/transport.h"
#include "transport/zmq_wire.h"

namespace symbiosis::tcp {
namespace {

class TcpChannel : public Channel {
 public:
  TcpChannel(uint64_t client_id, at::Device device)
      : Channel(TransportKind::kTcp, client_id, /*with_control_segment=*/false), device_(device) {}

  bool payload_in_frames() const override { return true; }

  void receive_frames(shm::CallHeader& h, std::vector<zmq::message_t> frames) override {
    h.in_offset = h.out_offset = next_key_++;
    frames_[h.in_offset] = std::move(frames);
  }

  proto::BufferRegistered register_buffer(const proto::RegisterBuffer&, UniqueFd) override {
    TORCH_CHECK(false, "a tcp client registers no payload buffer: its payload travels in its requests' frames");
  }

  Status check_payload(const shm::CallHeader& h, uint64_t in_bytes, uint64_t) const override {
    const auto it = frames_.find(h.in_offset);
    if (it == frames_.end() || it->second.empty()) {
      return {StatusCode::kMalformed, "expected the payload in frames after the header, got none"};
    }
    const size_t bytes = wire::frame_bytes(it->second);
    if (bytes != in_bytes) {
      return {StatusCode::kMalformed, "payload has " + std::to_string(bytes) + " bytes, expected " +
                                          std::to_string(in_bytes) + " for its shape and dtype"};
    }
    return Status::ok();
  }

  at::Tensor input(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) override {
    auto frames = frames_.extract(h.in_offset);
    TORCH_CHECK(!frames.empty(), "internal: tcp call ", h.request_id, " has no payload frame");
    return wire::frames_to_tensor(std::move(frames.mapped()), dtype, shape);
  }

  // Host memory for the reply's frame; pinned on a GPU executor, so the result comes down by DMA.
  at::Tensor destination(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) override {
    auto rows = at::empty(shape, at::TensorOptions().dtype(dtype).pinned_memory(device_.is_cuda()));
    results_[h.out_offset] = rows;
    return rows;
  }

 protected:
  void ok_reply(const shm::CallHeader& h, proto::Reply& reply, std::vector<zmq::message_t>& payload) override {
    auto result = results_.extract(h.out_offset);
    TORCH_CHECK(!result.empty(), "internal: tcp call ", h.request_id, " has no result");
    const at::Tensor& rows = result.mapped();
    reply.set_dtype(wire::to_proto(rows.scalar_type()));
    reply.add_shape(rows.size(0));
    reply.add_shape(rows.size(1));
    payload = wire::tensor_frames(rows);
  }

  void after_refusal(const shm::CallHeader& h) override {
    frames_.erase(h.in_offset);
    results_.erase(h.out_offset);
  }

 private:
  at::Device device_;
  uint64_t next_key_ = 1;
  std::unordered_map<uint64_t, std::vector<zmq::message_t>> frames_;  // by call, until its batch reads them
  std::unordered_map<uint64_t, at::Tensor> results_;                  // by call, until its reply
};

// ZeroMQ is all tcp needs: always.
bool available() { return true; }

}  // namespace

std::shared_ptr<Channel> make_channel(const ChannelContext& context) {
  auto channel = std::make_shared<TcpChannel>(context.client_id, context.device);
  return channel;
}

// The client's end (tcp_client.cpp).
std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options);

// [Transports]: this transport's row in transport.cpp's table.
extern const TransportPlugin kPlugin{TransportKind::kTcp, &available, &make_channel, &make_client};

}  // namespace symbiosis::tcp
