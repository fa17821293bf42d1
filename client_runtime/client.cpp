#include "client_runtime/client.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "common/checkpoint.h"
#include "transport/client_transport.h"
#include "transport/transport.h"
#include "transport/zmq_wire.h"

namespace symbiosis {

void ClientOptions::validate() const {
  const std::string endpoint_wrong = wire::endpoint_problem(endpoint);
  TORCH_CHECK(endpoint_wrong.empty(), "client option endpoint ", endpoint_wrong);
  TORCH_CHECK(timeout_ms > 0, "client option timeout_ms must be positive, got ", timeout_ms);
  TORCH_CHECK(connect_timeout_ms > 0, "client option connect_timeout_ms must be positive, got ", connect_timeout_ms);
  TORCH_CHECK(spin_us >= -1, "client option spin_us must be >= 0 (or -1: by device), got ", spin_us);
  TORCH_CHECK(transport == "auto" || parse_transport(transport), "client option transport '", transport,
              "' is not one of auto, ", transport_names());
  TORCH_CHECK(control == "auto" || control == "zmq", "client option control '", control,
              "' is not one of auto, zmq");
  if (privacy.mask) privacy.validate();
  TORCH_CHECK(executor_key.empty() == key_file.empty(), "client options executor_key and key_file go together: ",
              executor_key.empty() ? "key_file" : "executor_key", " is given without the other");
  try {
    const at::Device d(device);
    TORCH_CHECK(d.is_cpu() || d.is_cuda(), "");
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "client option device '", device, "' should be cpu or cuda:N");
  }
}

class Client::Impl {
 public:
  explicit Impl(const ClientOptions& o) : options(o), socket(o.endpoint, o.timeout_ms, keys_of(o), o.connect_timeout_ms) {}

  static ClientKeys keys_of(const ClientOptions& o) {
    if (o.executor_key.empty()) return {};
    return {keys::public_key(o.executor_key), keys::read(o.key_file, /*need_secret=*/true)};
  }

  ClientOptions options;
  ControlSocket socket;
  std::unique_ptr<ClientTransport> transport;
  std::string transport_name;
  uint64_t client_id = 0;
  std::string model_hash;
  std::vector<LayerInfo> layers;
  std::unordered_map<std::string, size_t> by_name;
  std::vector<LayerInfo> groups;

  std::mutex call_mutex;         // serializes calls: one transport, one buffer
  uint64_t next_request_id = 1;  // guarded by call_mutex
  std::atomic<proto::LatencyClass> latency{proto::FINE_TUNING};
  std::atomic<uint64_t> calls{0};  // sent: a capture's recordings count when a replay sends them
  bool capturing = false;          // guarded by call_mutex
  std::unique_ptr<NoiseMask> mask;  // [Noise masking], when the client asked for it

  // [Noise masking] with effects computed here: the base weights of a layer or group from the
  // checkpoint the options name, which must be the executor's model, rounded as the executor
  // holds them. Empty without effects_checkpoint.
  NoiseMask::LoadWeights effect_weights() {
    const auto& dir = options.privacy.effects_checkpoint;
    if (dir.empty()) return {};
    std::shared_ptr<Checkpoint> checkpoint = Checkpoint::open(dir);
    TORCH_CHECK(checkpoint->model_hash() == model_hash, "privacy option effects_checkpoint: ", dir,
                " holds another model than the executor's (model hash ", checkpoint->model_hash(), ", the executor's ",
                model_hash, ")");
    return [this, checkpoint](const LayerInfo& layer) {
      auto one = [&](const LayerInfo& l) {
        auto weight = checkpoint->tensor(l.name + ".weight");
        if (l.kind == LayerKind::kConv1D) weight = weight.t();  // [in, out] -> [out, in]
        NoiseMask::Weights w{weight.to(l.dtype).to(at::kFloat), {}};
        if (l.bias) w.bias = checkpoint->tensor(l.name + ".bias").to(l.dtype).to(at::kFloat);
        return w;
      };
      if (layer.members.empty()) return one(layer);
      std::vector<at::Tensor> weights, biases;
      for (const uint32_t id : layer.members) {
        const auto member = std::find_if(layers.begin(), layers.end(), [id](const LayerInfo& l) { return l.id == id; });
        TORCH_CHECK(member != layers.end(), "internal: group '", layer.name, "' names layer ", id, ", which is not served");
        auto w = one(*member);
        weights.push_back(w.weight);
        if (w.bias.defined()) biases.push_back(w.bias);
      }
      return NoiseMask::Weights{at::cat(weights, 0), biases.empty() ? at::Tensor() : at::cat(biases, 0)};
    };
  }

  // The masked calls' way to the executor: `layer`'s calls, as the mask names them.
  NoiseMask::Send sender(const LayerInfo& layer) {
    return [this, &layer](NoiseMask::Op op, const at::Tensor& x) {
      return call(layer, op == NoiseMask::Op::kForward ? proto::FORWARD
                         : op == NoiseMask::Op::kForwardNoBias ? proto::FORWARD_NO_BIAS
                                                               : proto::BACKWARD_INPUT,
                  x);
    };
  }

  at::Tensor call(const LayerInfo& layer, proto::Op op, const at::Tensor& x) {
    // One scope per call for profilers (LibTorch's RecordFunction): free while none listens.
    RECORD_FUNCTION("symbiosis::executor_call", c10::ArrayRef<const c10::IValue>{});
    // Checked here as the executor would, for every transport: the refusal of a call ordered on
    // the GPU ([Stream-ordered hand-off]) would reach the caller only at its next call.
    const bool backward = op == proto::BACKWARD_INPUT;
    const int64_t features = backward ? layer.out_features : layer.in_features;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == features && x.scalar_type() == layer.dtype, "layer '", layer.name, "' (",
                backward ? "backward" : "forward", ") takes [tokens, ", features, "] in ", layer.dtype, ", got ",
                x.sizes(), " in ", x.scalar_type());
    std::lock_guard<std::mutex> lock(call_mutex);
    CallSpec spec{&layer, op, next_request_id++, latency.load(), backward ? layer.in_features : layer.out_features};
    if (!capturing) calls++;
    // Every payload reads the input's rows as they lie in memory.
    return transport->call(spec, x.contiguous());
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::shared_ptr<Client> Client::connect(const ClientOptions& options) {
  options.validate();
  auto impl = std::make_unique<Impl>(options);
  proto::Envelope hello;
  hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
  hello.mutable_hello()->set_tenant(options.tenant);
  hello.mutable_hello()->set_expected_model_hash(options.expected_model_hash);
  hello.mutable_hello()->set_transport(options.transport);
  hello.mutable_hello()->set_control(options.control);
  *hello.mutable_hello()->mutable_placement() = local_placement(options.device);
  const auto welcome = impl->socket.handshake(std::move(hello));
  impl->client_id = welcome.client_id();
  impl->model_hash = welcome.model_hash();
  for (const auto& layer : welcome.layers()) {
    impl->by_name[layer.name()] = impl->layers.size();
    impl->layers.push_back(wire::from_proto(layer));
  }
  for (const auto& group : welcome.groups()) impl->groups.push_back(wire::from_proto(group));
  const auto kind = parse_transport(welcome.transport().empty() ? "tcp" : welcome.transport());
  TORCH_CHECK(kind, "executor chose transport '", welcome.transport(), "', which this client does not know (it knows ",
              transport_names(), ")");
  impl->transport_name = transport_name(*kind);
  const ClientEndOptions end_options{at::Device(options.device), options.spin_us, options.direct_operands};
  impl->transport = plugin(*kind).make_client(impl->socket, welcome, end_options);
  impl->latency = wire::to_proto(options.latency_class);
  if (options.privacy.mask) impl->mask = std::make_unique<NoiseMask>(options.privacy, impl->effect_weights());
  return std::shared_ptr<Client>(new Client(std::move(impl)));
}

Client::~Client() {
  try {
    impl_->transport.reset();
    proto::Envelope bye;
    bye.mutable_goodbye();
    impl_->socket.send(bye);
  } catch (...) {
    // Leaving quietly is fine: the executor forgets clients that are gone.
  }
}

uint64_t Client::client_id() const { return impl_->client_id; }
const std::string& Client::model_hash() const { return impl_->model_hash; }
const std::vector<LayerInfo>& Client::layers() const { return impl_->layers; }
uint64_t Client::calls() const { return impl_->calls; }
const std::string& Client::transport() const { return impl_->transport_name; }

const std::vector<LayerInfo>& Client::groups() const { return impl_->groups; }

const LayerInfo* Client::group(const std::vector<uint32_t>& members) const {
  for (const auto& group : impl_->groups) {
    if (group.members == members) return &group;
  }
  return nullptr;
}

const LayerInfo* Client::find_layer(const std::string& name) const {
  auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->layers[it->second];
}

void Client::set_latency_class(LatencyClass c) { impl_->latency = wire::to_proto(c); }
LatencyClass Client::latency_class() const { return wire::latency_from_proto(impl_->latency.load()); }

void Client::begin_capture() {
  {
    std::lock_guard<std::mutex> lock(impl_->call_mutex);
    impl_->transport->begin_capture();
    impl_->capturing = true;
  }
  if (impl_->mask) impl_->mask->begin_capture();
}

std::shared_ptr<const CapturedCalls> Client::end_capture() {
  std::shared_ptr<const CapturedCalls> calls;
  {
    std::lock_guard<std::mutex> lock(impl_->call_mutex);
    impl_->capturing = false;
    calls = impl_->transport->end_capture();
  }
  if (!impl_->mask) return calls;
  // [Masked captures]: each replay counts the banks' calls (and redraws those then due).
  auto masked = std::make_shared<CapturedCalls>(calls ? *calls : CapturedCalls{});
  masked->after_replay = [impl = impl_.get(), use = impl_->mask->end_capture()] {
    impl->mask->replayed(use, [impl](const LayerInfo& layer) { return impl->sender(layer); });
  };
  return masked;
}

void Client::replay(const CapturedCalls& calls) {
  {
    std::lock_guard<std::mutex> lock(impl_->call_mutex);
    const uint64_t first = impl_->next_request_id;
    impl_->next_request_id += calls.records.size();
    impl_->calls += calls.records.size();
    impl_->transport->replay(calls, first);
  }
  // Outside the call lock: a bank redrawn there asks the executor for its effects.
  if (calls.after_replay) calls.after_replay();
}

void Client::settle() {
  std::lock_guard<std::mutex> lock(impl_->call_mutex);
  impl_->transport->settle();
}

at::Tensor Client::forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias) {
  if (impl_->mask) return impl_->mask->forward(layer, x, with_bias, impl_->sender(layer));
  return impl_->call(layer, with_bias ? proto::FORWARD : proto::FORWARD_NO_BIAS, x);
}

at::Tensor Client::backward_input(const LayerInfo& layer, const at::Tensor& grad_out) {
  if (impl_->mask) return impl_->mask->backward_input(layer, grad_out, impl_->sender(layer));
  return impl_->call(layer, proto::BACKWARD_INPUT, grad_out);
}

const NoiseMask* Client::noise_mask() const { return impl_->mask.get(); }
NoiseMask* Client::noise_mask() { return impl_->mask.get(); }

}  // namespace symbiosis
