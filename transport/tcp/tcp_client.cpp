// The client's end of the "tcp" transport: a call's header and payload in ZeroMQ frames on the
// Client's control socket; the reply brings the result in frames ([Bounded frames] in
// transport/zmq_wire.h). Tensors on a GPU are staged
// through host memory.
#include <c10/util/Exception.h>

#include "transport/client_transport.h"
#include "transport/zmq_wire.h"

namespace symbiosis::tcp {
namespace {

class TcpTransport : public ClientTransport {
 public:
  explicit TcpTransport(ControlSocket& socket) : socket_(socket) {}

  at::Tensor call(const CallSpec& spec, const at::Tensor& x) override {
    const auto payload = x.to(at::kCPU);  // contiguous (Client)
    socket_.send(request_envelope(spec, x), &payload);
    std::vector<zmq::message_t> frames;
    const auto reply = await_reply(socket_, spec, frames);
    if (reply.has_error() && reply.error().code() != proto::OK) {
      throw_executor_error(reply.error().code(), reply.error().message(), "layer '" + spec.layer->name + "'",
                           /*can_send_again=*/true);
    }
    frames.erase(frames.begin());  // the Reply's
    const auto dtype = wire::from_proto(reply.dtype());
    TORCH_CHECK(
        !frames.empty() && reply.shape_size() == 2 && reply.shape(0) >= 0 && reply.shape(1) >= 0 &&
            wire::frame_bytes(frames) == static_cast<size_t>(reply.shape(0) * reply.shape(1)) * at::elementSize(dtype),
        "executor reply to request ", spec.request_id, " lacks its payload");
    auto out = wire::frames_to_tensor(std::move(frames), dtype, {reply.shape(0), reply.shape(1)});
    return x.device().is_cpu() ? out : out.to(x.device());
  }

 private:
  ControlSocket& socket_;
};

}  // namespace

std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome&, const ClientEndOptions&) {
  return std::make_unique<TcpTransport>(socket);
}

}  // namespace symbiosis::tcp
