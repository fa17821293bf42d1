#include "base_executor/parts.h"

#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "base_executor/part_groups.h"

namespace symbiosis {
namespace {

constexpr int64_t kOfferFields = 5;  // kind, layer, op, tokens, features

std::pair<std::string, uint16_t> host_and_port(const std::string& rendezvous) {
  const auto colon = rendezvous.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rendezvous.size(),
              "executor option --rendezvous must be HOST:PORT, got '", rendezvous, "'");
  int port = 0;
  try {
    port = std::stoi(rendezvous.substr(colon + 1));
  } catch (const std::exception&) {
  }
  TORCH_CHECK(port > 0 && port < 65536, "executor option --rendezvous: bad port in '", rendezvous, "'");
  std::string host = rendezvous.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return {host, static_cast<uint16_t>(port)};
}

bool loopback(const std::string& host) { return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0; }

}  // namespace

std::string free_loopback_rendezvous() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool bound = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  if (fd >= 0) ::close(fd);
  TORCH_CHECK(bound, "cannot find a free loopback port for the parts' rendezvous");
  return "127.0.0.1:" + std::to_string(ntohs(address.sin_port));
}
void PartOptions::validate() const {
  if (!sharded()) return;
  TORCH_CHECK(world_size >= 1, "executor option --world-size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "executor option --rank must be 0 to --world-size - 1 (", world_size - 1,
              "), got ", rank);
  TORCH_CHECK(timeout.count() > 0, "executor option --part-timeout must be > 0 ms, got ", timeout.count());
  host_and_port(rendezvous);
}

Parts::Parts(const PartOptions& options, at::Device device)
    : options_(options), device_(device), groups_(std::make_unique<PartGroups>()) {}

Parts::~Parts() = default;

void Parts::finish(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (const auto* error = dynamic_cast<const c10::Error*>(&e)) message = error->what_without_backtrace();
    if (const auto line = message.find('\n'); line != std::string::npos) message.resize(line);
    lost_ = Status(StatusCode::kUnavailable, "executor " + name() + " lost another part (" + what +
                                                 " failed: " + message + "); this sharded executor stops");
    TORCH_CHECK(false, lost_->message());
  }
}

void Parts::leave() {
  if (lost_) return;
  try {
    exchange({RoundOffer::kLeaving});
  } catch (const std::exception& e) {
    spdlog::warn("executor {} could not tell the other parts it stops: {}", name(), e.what());
  }
}

std::string Parts::name() const {
  return "part " + std::to_string(options_.rank) + " of " + std::to_string(options_.world_size);
}

PartGroups PartGroups::join(const PartOptions& options, at::Device device, const std::string& name) {
  options.validate();
  PartGroups groups;
  const auto [host, port] = host_and_port(options.rendezvous);
  c10d::TCPStoreOptions store_options;
  store_options.port = port;
  store_options.isServer = options.rank == 0;
  store_options.numWorkers = options.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  try {
    groups.store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "executor ", name, ": the rendezvous at ", options.rendezvous, " failed within ",
                options.timeout.count(), " ms (are all ", options.world_size,
                " parts started, rank 0 there?): ", e.what());
  }
  auto gloo = c10d::ProcessGroupGloo::Options::create();
  gloo->timeout = options.timeout;
  if (!options.interface.empty()) {
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(options.interface));
  } else if (loopback(host)) {
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  groups.control = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("control", groups.store), options.rank, options.world_size, gloo);
  groups.data = groups.control;
  if (device.is_cuda()) {
#ifdef USE_C10D_NCCL
    // The group is made, and bound, on the part's own GPU: not on the calling thread's current one.
    c10::cuda::CUDAGuard on_device(device);
    auto nccl = c10d::ProcessGroupNCCL::Options::create();
    nccl->timeout = options.timeout;
    groups.data = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("data", groups.store), options.rank, options.world_size, nccl);
    groups.data->setBoundDeviceId(device);
#else
    TORCH_CHECK(false, "executor ", name, ": a sharded executor on a GPU needs NCCL, and this build has none");
#endif
  }
  return groups;
}

std::unique_ptr<Parts> Parts::join(const PartOptions& options, at::Device device) {
  auto parts = std::unique_ptr<Parts>(new Parts(options, device));
  *parts->groups_ = PartGroups::join(options, device, parts->name());
  spdlog::info("joined the executor's parts as {} (rendezvous {})", parts->name(), options.rendezvous);
  return parts;
}

std::vector<RoundOffer> Parts::exchange(const RoundOffer& mine) {
  const int n = size();
  std::vector<at::Tensor> input{at::tensor({static_cast<int64_t>(mine.kind), static_cast<int64_t>(mine.layer_id),
                                            static_cast<int64_t>(mine.op), mine.tokens, mine.features},
                                           at::kLong)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int i = 0; i < n; ++i) output[0].push_back(at::empty({kOfferFields}, at::kLong));
  finish(groups_->control->allgather(output, input), "a round's exchange");
  std::vector<RoundOffer> offers(n);
  for (int i = 0; i < n; ++i) {
    const auto* f = output[0][i].data_ptr<int64_t>();
    offers[i] = {static_cast<RoundOffer::Kind>(f[0]), static_cast<uint32_t>(f[1]), static_cast<LayerOp>(f[2]), f[3],
                 f[4]};
  }
  return offers;
}

at::Tensor Parts::compute(const BaseModel& model, int owner, const RoundOffer& batch,
                          const std::function<at::Tensor()>& input) {
  const auto& layer = model.layer(batch.layer_id);
  const auto options = at::TensorOptions().dtype(layer.dtype).device(device_);
  const bool mine = owner == rank();
  std::exception_ptr failure;
  at::Tensor x;
  if (mine) {
    try {
      x = input().contiguous();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (!x.defined())
    x = mine ? at::zeros({batch.tokens, batch.features}, options) : at::empty({batch.tokens, batch.features}, options);
  // 1. Every part gets the owner's input.
  std::vector<at::Tensor> broadcast{x};
  c10d::BroadcastOptions from_owner;
  from_owner.rootRank = owner;
  finish(groups_->data->broadcast(broadcast, from_owner), "broadcasting a batch's input");
  at::Tensor result;
  const auto& blocks = model.columns(batch.layer_id, rank());
  if (batch.op == LayerOp::kBackwardInput) {
    // 2. Backward-input: each part's rows' share of the sum, summed at the owner.
    std::vector<at::Tensor> pieces;
    for (const auto& b : blocks) pieces.push_back(x.narrow(1, b.global, b.width));
    auto share = model.compute(batch.layer_id, batch.op, pieces.size() == 1 ? pieces[0] : at::cat(pieces, 1));
    std::vector<at::Tensor> sum{share};
    c10d::ReduceOptions to_owner;
    to_owner.rootRank = owner;
    to_owner.reduceOp = c10d::ReduceOp::SUM;
    finish(groups_->data->reduce(sum, to_owner), "summing a batch's input gradients");
    if (mine) result = share;
  } else {
    // 2. Forward: each part's columns, gathered at the owner (every part sends the widest part's
    // width: the collective wants one size).
    int64_t widest = 0;
    for (int part = 0; part < size(); ++part) widest = std::max(widest, model.local_width(batch.layer_id, part));
    const int64_t width = model.local_width(batch.layer_id, rank());
    auto padded =
        width == widest ? at::empty({batch.tokens, widest}, options) : at::zeros({batch.tokens, widest}, options);
    if (width == widest) {
      model.compute_into(batch.layer_id, batch.op, x, padded);
    } else {
      padded.narrow(1, 0, width).copy_(model.compute(batch.layer_id, batch.op, x));
    }
    std::vector<std::vector<at::Tensor>> gathered(mine ? 1 : 0);  // only the owner receives
    if (mine) {
      for (int part = 0; part < size(); ++part) gathered[0].push_back(at::empty({batch.tokens, widest}, options));
    }
    std::vector<at::Tensor> sent{padded};
    c10d::GatherOptions to_owner;
    to_owner.rootRank = owner;
    finish(groups_->data->gather(gathered, sent, to_owner), "gathering a batch's output columns");
    if (mine) {
      result = at::empty({batch.tokens, layer.out_features}, options);
      for (int part = 0; part < size(); ++part) {
        for (const auto& b : model.columns(batch.layer_id, part)) {
          result.narrow(1, b.global, b.width).copy_(gathered[0][part].narrow(1, b.local, b.width));
        }
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  return result;
}

}  // namespace symbiosis
