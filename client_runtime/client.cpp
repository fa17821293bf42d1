#include "client_runtime/client.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "transport/zmq_wire.h"

namespace symbiosis {

namespace {
proto::LatencyClass to_proto(LatencyClass c) {
  switch (c) {
    case LatencyClass::kInferenceDecode: return proto::INFERENCE_DECODE;
    case LatencyClass::kInferencePrefill: return proto::INFERENCE_PREFILL;
    default: return proto::FINE_TUNING;
  }
}
}  // namespace

class Client::Impl {
 public:
  ClientOptions options;
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::dealer};
  uint64_t client_id = 0;
  std::string model_hash;
  std::vector<LayerInfo> layers;
  std::unordered_map<std::string, size_t> by_name;

  std::mutex call_mutex;  // serializes calls on the socket
  uint64_t next_request_id = 1;  // guarded by call_mutex
  std::atomic<proto::LatencyClass> latency{proto::FINE_TUNING};
  std::atomic<uint64_t> calls{0};

  // Receives the next message within the timeout, or throws naming the executor.
  std::vector<zmq::message_t> receive(const char* waiting_for) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(options.timeout_ms));
    TORCH_CHECK(item.revents & ZMQ_POLLIN, "executor at ", options.endpoint, " did not answer ", waiting_for,
                " within ", options.timeout_ms, " ms (is it running and reachable?)");
    return wire::recv_all(socket);
  }

  static proto::Envelope parse_or_throw(const std::vector<zmq::message_t>& frames) {
    proto::Envelope env;
    TORCH_CHECK(!frames.empty() && wire::parse(frames[0], &env), "executor sent a message that does not parse");
    if (env.has_error()) {
      TORCH_CHECK(false, "executor error (", proto::ErrorCode_Name(env.error().code()), "): ", env.error().message());
    }
    return env;
  }

  at::Tensor call(const LayerInfo& layer, proto::Op op, const at::Tensor& x) {
    std::lock_guard<std::mutex> lock(call_mutex);
    const uint64_t id = next_request_id++;
    proto::Envelope env;
    auto* r = env.mutable_request();
    r->set_request_id(id);
    r->set_layer_id(layer.id);
    r->set_op(op);
    r->set_dtype(wire::to_proto(x.scalar_type()));
    r->add_shape(x.size(0));
    r->add_shape(x.size(1));
    r->set_latency_class(latency.load());
    auto payload = x.to(at::kCPU).contiguous();
    socket.send(wire::serialize(env), zmq::send_flags::sndmore);
    socket.send(wire::tensor_frame(payload), zmq::send_flags::none);
    calls++;
    while (true) {
      auto frames = receive("a layer request");
      auto reply_env = parse_or_throw(frames);
      TORCH_CHECK(reply_env.has_reply(), "executor answered a request with something other than a reply");
      const auto& reply = reply_env.reply();
      if (reply.request_id() != id) continue;  // a late answer to a call that timed out
      if (reply.has_error() && reply.error().code() != proto::OK) {
        TORCH_CHECK(false, "executor error (", proto::ErrorCode_Name(reply.error().code()), ") on layer '",
                    layer.name, "': ", reply.error().message());
      }
      TORCH_CHECK(frames.size() == 2 && reply.shape_size() == 2, "executor reply to request ", id,
                  " lacks its payload");
      auto out = wire::frame_to_tensor(std::move(frames[1]), wire::from_proto(reply.dtype()),
                                       {reply.shape(0), reply.shape(1)});
      return x.device().is_cpu() ? out : out.to(x.device());
    }
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::shared_ptr<Client> Client::connect(const ClientOptions& options) {
  TORCH_CHECK(options.timeout_ms > 0, "client option timeout_ms must be positive, got ", options.timeout_ms);
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->socket.set(zmq::sockopt::linger, 0);
  try {
    impl->socket.connect(options.endpoint);
  } catch (const zmq::error_t& e) {
    TORCH_CHECK(false, "cannot connect to executor endpoint '", options.endpoint, "': ", e.what());
  }
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_tenant(options.tenant);
  hello.mutable_hello()->set_expected_model_hash(options.expected_model_hash);
  hello.mutable_hello()->set_transport("tcp");
  impl->socket.send(wire::serialize(hello), zmq::send_flags::none);
  auto env = Impl::parse_or_throw(impl->receive("the handshake"));
  TORCH_CHECK(env.has_welcome(), "executor answered the handshake with something other than Welcome");
  const auto& welcome = env.welcome();
  impl->client_id = welcome.client_id();
  impl->model_hash = welcome.model_hash();
  for (const auto& layer : welcome.layers()) {
    impl->by_name[layer.name()] = impl->layers.size();
    impl->layers.push_back(wire::from_proto(layer));
  }
  impl->latency = to_proto(options.latency_class);
  return std::shared_ptr<Client>(new Client(std::move(impl)));
}

Client::~Client() {
  try {
    proto::Envelope bye;
    bye.mutable_goodbye();
    impl_->socket.send(wire::serialize(bye), zmq::send_flags::dontwait);
  } catch (...) {
    // Leaving quietly is fine: the executor forgets idle clients.
  }
}

uint64_t Client::client_id() const { return impl_->client_id; }
const std::string& Client::model_hash() const { return impl_->model_hash; }
const std::vector<LayerInfo>& Client::layers() const { return impl_->layers; }
uint64_t Client::calls() const { return impl_->calls; }

const LayerInfo* Client::find_layer(const std::string& name) const {
  auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->layers[it->second];
}

void Client::set_latency_class(LatencyClass c) {
  impl_->latency = to_proto(c);
}

at::Tensor Client::forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) {
  return impl_->call(layer, with_bias ? proto::FORWARD : proto::FORWARD_NO_BIAS, x);
}

at::Tensor Client::backward_input(const LayerInfo& layer, const at::Tensor& grad_out) {
  return impl_->call(layer, proto::BACKWARD_INPUT, grad_out);
}

}  // namespace symbiosis
