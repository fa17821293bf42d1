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
constexpr int kMostRoundBatches = 64;

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
  TORCH_CHECK(rank >= 0 && rank < world_size, "executor option --rank must be 0 to --world-size - 1 (",
              world_size - 1, "), got ", rank);
  TORCH_CHECK(timeout.count() > 0, "executor option --part-timeout must be > 0 ms, got ", timeout.count());
  TORCH_CHECK(round_batches >= 1 && round_batches <= kMostRoundBatches, "executor option --round-batches must be 1 to ",
              kMostRoundBatches, ", got ", round_batches);
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
    lost_ = Status(StatusCode::kUnavailable, "executor " + name() + " lost another part (" + what + " failed: " +
                                                 message + "); this sharded executor stops");
    TORCH_CHECK(false, lost_->message());
  }
}

void Parts::leave() {
  if (lost_) return;
  try {
    exchange({{RoundOffer::kLeaving}});
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
                options.timeout.count(), " ms (are all ", options.world_size, " parts started, rank 0 there?): ",
                e.what());
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
  // Every part's offers must be the same size: all parts agree on --round-batches, or none starts.
  std::vector<at::Tensor> mine{at::tensor({static_cast<int64_t>(options.round_batches)}, at::kLong)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int i = 0; i < options.world_size; ++i) all[0].push_back(at::empty({1}, at::kLong));
  parts->finish(parts->groups_->control->allgather(all, mine), "agreeing on --round-batches");
  for (int i = 0; i < options.world_size; ++i) {
    const auto theirs = all[0][i].item<int64_t>();
    TORCH_CHECK(theirs == options.round_batches, "executor ", parts->name(), " has --round-batches ",
                options.round_batches, " but part ", i, " has ", theirs, ": every part must have the same");
  }
  spdlog::info("joined the executor's parts as {} (rendezvous {})", parts->name(), options.rendezvous);
  return parts;
}

std::vector<std::vector<RoundOffer>> Parts::exchange(const std::vector<RoundOffer>& mine) {
  const int n = size();
  const int64_t slots = options_.round_batches;
  TORCH_CHECK(static_cast<int64_t>(mine.size()) <= slots, "a part offered ", mine.size(), " batches in a round of at most ",
              slots);
  auto input = at::zeros({slots, kOfferFields}, at::kLong);  // kNone in the slots not offered
  auto* f = input.data_ptr<int64_t>();
  for (size_t i = 0; i < mine.size(); ++i, f += kOfferFields) {
    const auto& o = mine[i];
    f[0] = o.kind, f[1] = o.layer_id, f[2] = static_cast<int64_t>(o.op), f[3] = o.tokens, f[4] = o.features;
  }
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int i = 0; i < n; ++i) output[0].push_back(at::empty({slots, kOfferFields}, at::kLong));
  finish(groups_->control->allgather(output, inputs), "a round's exchange");
  std::vector<std::vector<RoundOffer>> offers(n);
  for (int i = 0; i < n; ++i) {
    const auto* g = output[0][i].data_ptr<int64_t>();
    for (int64_t slot = 0; slot < slots; ++slot, g += kOfferFields) {
      if (g[0] == RoundOffer::kNone) continue;
      offers[i].push_back({static_cast<RoundOffer::Kind>(g[0]), static_cast<uint32_t>(g[1]), static_cast<LayerOp>(g[2]),
                           g[3], g[4]});
    }
  }
  return offers;
}

std::vector<at::Tensor> Parts::compute(const BaseModel& model, int owner, const std::vector<RoundOffer>& batches,
                                       const std::function<std::vector<at::Tensor>()>& inputs) {
  const auto options = at::TensorOptions().dtype(model.layer(batches.at(0).layer_id).dtype).device(device_);
  const bool mine = owner == rank();
  // Where each batch's rows lie in the round's buffers (elements): its input, and its forward
  // output columns or backward-input share.
  std::vector<int64_t> input_at, output_at, widest(batches.size(), 0);
  int64_t input_size = 0, forward_size = 0, backward_size = 0;
  for (size_t i = 0; i < batches.size(); ++i) {
    const auto& b = batches[i];
    TORCH_CHECK(model.layer(b.layer_id).dtype == options.dtype(), "a round's batches must share one dtype");
    input_at.push_back(input_size);
    input_size += b.tokens * b.features;
    if (b.op == LayerOp::kBackwardInput) {  // [tokens, in features]: every part's share of the sum
      output_at.push_back(backward_size);
      backward_size += b.tokens * model.layer(b.layer_id).in_features;
    } else {
      // Every part sends the widest part's width: the gather wants one size from each.
      for (int part = 0; part < size(); ++part) widest[i] = std::max(widest[i], model.local_width(b.layer_id, part));
      output_at.push_back(forward_size);
      forward_size += b.tokens * widest[i];
    }
  }
  // 1. Every part gets the owner's inputs, in one buffer.
  std::exception_ptr failure;
  at::Tensor x;
  if (mine) {
    try {
      std::vector<at::Tensor> flat;
      for (const auto& input : inputs()) flat.push_back(input.contiguous().view(-1));
      x = flat.size() == 1 ? flat[0] : at::cat(flat);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (!x.defined()) x = mine ? at::zeros({input_size}, options) : at::empty({input_size}, options);
  std::vector<at::Tensor> broadcast{x};
  c10d::BroadcastOptions from_owner;
  from_owner.rootRank = owner;
  finish(groups_->data->broadcast(broadcast, from_owner), "broadcasting a round's inputs");
  // 2. Each part's share of every batch: forward columns (padded to the widest part's width) and
  // backward-input rows' parts of the sum, each kind in one buffer.
  auto forward = at::empty({forward_size}, options), backward = at::empty({backward_size}, options);
  for (size_t i = 0; i < batches.size(); ++i) {
    const auto& b = batches[i];
    const auto input = x.narrow(0, input_at[i], b.tokens * b.features).view({b.tokens, b.features});
    if (b.op == LayerOp::kBackwardInput) {
      const int64_t in = model.layer(b.layer_id).in_features;
      auto out = backward.narrow(0, output_at[i], b.tokens * in).view({b.tokens, in});
      std::vector<at::Tensor> pieces;
      for (const auto& block : model.columns(b.layer_id, rank())) pieces.push_back(input.narrow(1, block.global, block.width));
      model.compute_into(b.layer_id, b.op, pieces.size() == 1 ? pieces[0] : at::cat(pieces, 1), out);
      continue;
    }
    auto out = forward.narrow(0, output_at[i], b.tokens * widest[i]).view({b.tokens, widest[i]});
    const int64_t width = model.local_width(b.layer_id, rank());
    if (width == widest[i]) {
      model.compute_into(b.layer_id, b.op, input, out);
    } else {
      out.narrow(1, 0, width).copy_(model.compute(b.layer_id, b.op, input));
    }
  }
  // 3. The owner gathers every part's columns and sums the parts' shares.
  std::vector<std::vector<at::Tensor>> gathered(mine ? 1 : 0);  // only the owner receives
  if (forward_size > 0) {
    if (mine) {
      for (int part = 0; part < size(); ++part) gathered[0].push_back(at::empty({forward_size}, options));
    }
    std::vector<at::Tensor> sent{forward};
    c10d::GatherOptions to_owner;
    to_owner.rootRank = owner;
    finish(groups_->data->gather(gathered, sent, to_owner), "gathering a round's output columns");
  }
  if (backward_size > 0) {
    std::vector<at::Tensor> sum{backward};
    c10d::ReduceOptions to_owner;
    to_owner.rootRank = owner;
    to_owner.reduceOp = c10d::ReduceOp::SUM;
    finish(groups_->data->reduce(sum, to_owner), "summing a round's input gradients");
  }
  if (failure) std::rethrow_exception(failure);
  std::vector<at::Tensor> results;
  if (!mine) return results;
  for (size_t i = 0; i < batches.size(); ++i) {
    const auto& b = batches[i];
    if (b.op == LayerOp::kBackwardInput) {
      const int64_t in = model.layer(b.layer_id).in_features;
      results.push_back(backward.narrow(0, output_at[i], b.tokens * in).view({b.tokens, in}));
      continue;
    }
    auto result = at::empty({b.tokens, model.layer(b.layer_id).out_features}, options);
    for (int part = 0; part < size(); ++part) {
      const auto columns = gathered[0][part].narrow(0, output_at[i], b.tokens * widest[i]).view({b.tokens, widest[i]});
      for (const auto& block : model.columns(b.layer_id, part)) {
        result.narrow(1, block.global, block.width).copy_(columns.narrow(1, block.local, block.width));
      }
    }
    results.push_back(result);
  }
  return results;
}

}  // namespace symbiosis
