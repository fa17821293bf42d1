#include "base_executor/batch_runner.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>

#include "base_executor/cpu_threads.h"
#include "base_executor/parts.h"
#include "base_executor/tracing.h"
#include "common/cuda.h"
#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/batched_copy.h"
#endif

namespace symbiosis {
namespace {

// From this many tokens a request's GEMM keeps an H100 busy alone: see [Batch data path].
constexpr int64_t kInPlaceTokens = 512;

// The width of a call's result rows.
int64_t result_features(const LayerInfo& layer, LayerOp op) {
  return op == LayerOp::kBackwardInput ? layer.in_features : layer.out_features;
}

// targets[i] = sources[i] (equal sizes): one kernel for all of them on a GPU, copies on a CPU.
void copy_rows(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& targets) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (sources[0].is_cuda()) return kernels::copy_tensors(sources, targets);
#endif
  for (size_t i = 0; i < sources.size(); ++i) targets[i].copy_(sources[i]);
}

// `inputs` packed into x's rows in order, the layer's GEMM into y, and y's rows to `destinations`
// (each as many rows as its input): a packed batch replayed, or calls launched together.
void packed_gemm(const BaseModel& model, uint32_t layer_id, LayerOp op, const std::vector<at::Tensor>& inputs,
                 const std::vector<at::Tensor>& destinations, const at::Tensor& x, at::Tensor& y) {
  std::vector<at::Tensor> packed, results;
  int64_t row = 0;
  for (const auto& input : inputs) {
    packed.push_back(x.narrow(0, row, input.size(0)));
    results.push_back(y.narrow(0, row, input.size(0)));
    row += input.size(0);
  }
  copy_rows(inputs, packed);
  model.compute_into(layer_id, op, x, y);
  copy_rows(results, destinations);
}

}  // namespace

#ifdef SYMBIOSIS_WITH_CUDA
// [Replayed batches]
// A packed batch of captured calls (the decode steps of inference tenants in step: [Decode
// alignment] in batching.h) comes again at every step with the same operands: the same calls of the
// same clients, their inputs and destinations at the same addresses. Its host work (the packing
// kernel, the GEMM library's launches, the unpacking kernel and the tensors around them) is then
// recorded once into a CUDA graph, with buffers of its own for the packed rows, and each later
// batch of those calls is one launch, as a single captured call is ([Replayed calls] in
// common/cuda.h). Rows go in the order of their inputs' addresses, so the same calls make the same
// batch whatever order they came in. A batch is recorded the second time it comes
// (one that never comes again costs nothing); the recordings' buffers hold at most kBytes, the
// least recently used going first, and batches over kMaxTokens, whose GEMM outlasts its launches
// anyway, are not recorded.
class ReplayedBatches {
 public:
  explicit ReplayedBatches(const BaseModel& model) : model_(model) {}

  // Enqueues the batch on the current stream from its recording, and true; false when it is not
  // recorded (yet): the caller computes it. Every call's destination is set.
  bool run(CallBatcher::Batch& batch, const std::vector<at::Tensor>& inputs) {
    auto& requests = batch.requests;
    if (failed_ || batch.tokens > kMaxTokens) return false;
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& w = requests[i].payload;
      if (!w.channel->recurs(w.header) || !inputs[i].defined() || !inputs[i].is_cuda() || !w.destination.defined() ||
          !w.destination.is_cuda()) {
        return false;
      }
    }
    std::vector<size_t> order(requests.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return inputs[a].data_ptr() < inputs[b].data_ptr(); });
    const cuda::Stream stream = cuda::current_stream(model_.device().index());
    Key key{batch.layer_id, static_cast<int>(batch.op), stream.handle, {}};
    for (size_t i : order) {
      std::get<3>(key).emplace_back(inputs[i].data_ptr(), requests[i].payload.destination.data_ptr(),
                                    requests[i].payload.header.tokens);
    }
    auto [it, added] = entries_.try_emplace(std::move(key));
    auto& entry = it->second;
    entry.last_use = ++uses_;
    if (!entry.work.valid()) {
      if (++entry.sightings < 2) {
        if (added) forget_sightings();
        return false;
      }
      if (!record(batch, inputs, order, entry, stream)) {
        entries_.erase(it);
        return false;
      }
      make_room(it);
    }
    entry.work.launch(stream);
    return true;
  }

 private:
  static constexpr int64_t kMaxTokens = 1024;
  static constexpr size_t kBytes = size_t{1} << 30;
  static constexpr size_t kMaxSightings = 4096;  // batches seen once, remembered at most

  // (layer, op, stream, each call's (input, destination, tokens) in row order)
  using Key = std::tuple<uint32_t, int, void*, std::vector<std::tuple<const void*, const void*, int64_t>>>;
  struct Entry {
    int sightings = 0;
    uint64_t last_use = 0;
    cuda::CapturedWork work;
    at::Tensor x, y;  // the packed input and result rows
  };

  bool record(CallBatcher::Batch& batch, const std::vector<at::Tensor>& inputs, const std::vector<size_t>& order,
              Entry& entry, cuda::Stream stream) {
    auto& requests = batch.requests;
    const auto& layer = model_.layer(batch.layer_id);
    const int64_t out_features = result_features(layer, batch.op);
    const auto options = at::TensorOptions().dtype(layer.dtype).device(model_.device());
    entry.x = at::empty({batch.tokens, requests[0].payload.header.features}, options);
    entry.y = at::empty({batch.tokens, out_features}, options);
    std::vector<at::Tensor> sources, destinations;
    for (size_t i : order) {
      sources.push_back(inputs[i]);
      destinations.push_back(requests[i].payload.destination);
    }
    try {
      entry.work = cuda::CapturedWork::capture(
          stream, [&] { packed_gemm(model_, batch.layer_id, batch.op, sources, destinations, entry.x, entry.y); });
    } catch (const c10::Error& e) {
      failed_ = true;
      spdlog::warn("packed batches run without graphs: {}", e.what_without_backtrace());
      return false;
    }
    bytes_ += entry.x.nbytes() + entry.y.nbytes();
    return true;
  }

  // Lets the least recently used recordings go until the buffers fit kBytes (`keep` stays).
  void make_room(std::map<Key, Entry>::const_iterator keep) {
    while (bytes_ > kBytes) {
      auto victim = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (it->second.work.valid() && it != keep &&
            (victim == entries_.end() || it->second.last_use < victim->second.last_use)) {
          victim = it;
        }
      }
      if (victim == entries_.end()) return;
      bytes_ -= victim->second.x.nbytes() + victim->second.y.nbytes();
      entries_.erase(victim);
    }
  }

  // Too many batches seen once: forget them (the recorded ones stay).
  void forget_sightings() {
    if (entries_.size() <= kMaxSightings) return;
    std::erase_if(entries_, [](const auto& e) { return !e.second.work.valid(); });
  }

  const BaseModel& model_;
  std::map<Key, Entry> entries_;
  uint64_t uses_ = 0;
  size_t bytes_ = 0;
  bool failed_ = false;
};
#else
class ReplayedBatches {};
#endif

BatchRunner::BatchRunner(const BaseModel& model, Statistics& statistics, InputObserver on_input, Parts* parts)
    : model_(model), statistics_(statistics), on_input_(std::move(on_input)), parts_(parts) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (model.device().is_cuda()) replays_ = std::make_unique<ReplayedBatches>(model);
#endif
}

BatchRunner::~BatchRunner() = default;

LayerOp to_layer_op(int32_t op) {
  switch (op) {
    case proto::BACKWARD_INPUT: return LayerOp::kBackwardInput;
    case proto::FORWARD_NO_BIAS: return LayerOp::kForwardNoBias;
    default: return LayerOp::kForward;
  }
}

void BatchRunner::enqueue(Channel& channel, const shm::CallHeader& h) {
  const auto& layer = model_.layer(h.layer_id);
  const auto op = to_layer_op(h.op);
  auto destination = channel.destination(h, layer.dtype, {h.tokens, result_features(layer, op)});
  model_.compute_into(h.layer_id, op, channel.input(h, layer.dtype, {h.tokens, h.features}), destination);
}

at::Tensor BatchRunner::packing_scratch(int64_t rows) {
  int64_t widest = 0;  // bytes of the widest row of any layer, in or out
  for (uint32_t i = 0; i < model_.layer_count(); ++i) {
    const auto& layer = model_.layer(i);
    widest = std::max(
        widest, std::max(layer.in_features, layer.out_features) * static_cast<int64_t>(c10::elementSize(layer.dtype)));
  }
  return at::empty({2, rows * widest}, at::TensorOptions().dtype(at::kByte).device(model_.device()));
}

void BatchRunner::enqueue_packed(const std::vector<std::pair<Channel*, shm::CallHeader>>& calls,
                                 const at::Tensor& scratch) {
  const auto& first = calls[0].second;
  const auto& layer = model_.layer(first.layer_id);
  const auto op = to_layer_op(first.op);
  const int64_t out_features = result_features(layer, op);
  int64_t rows = 0;
  for (const auto& [channel, h] : calls) rows += h.tokens;
  const auto element = static_cast<int64_t>(c10::elementSize(layer.dtype));
  const auto x =
      scratch[0].narrow(0, 0, rows * first.features * element).view(layer.dtype).view({rows, first.features});
  auto y = scratch[1].narrow(0, 0, rows * out_features * element).view(layer.dtype).view({rows, out_features});
  std::vector<at::Tensor> inputs, destinations;
  for (const auto& [channel, h] : calls) {
    inputs.push_back(channel->input(h, layer.dtype, {h.tokens, h.features}));
    destinations.push_back(channel->destination(h, layer.dtype, {h.tokens, out_features}));
  }
  packed_gemm(model_, first.layer_id, op, inputs, destinations, x, y);
}

void BatchRunner::warm_up_stream() {
#ifdef SYMBIOSIS_WITH_CUDA
  if (model_.layer_count() == 0) return;
  const auto& layer = model_.layer(0);
  // More rows than the few-row kernel takes (kernels/few_rows_gemm.h), so the GEMM library runs.
  const auto x = at::zeros({16, layer.in_features}, at::TensorOptions().dtype(layer.dtype).device(model_.device()));
  model_.compute(0, LayerOp::kForward, x);
  cuda::synchronize_stream(cuda::current_stream(model_.device().index()));
#endif
}

std::vector<at::Tensor> BatchRunner::read_inputs(CallBatcher::Batch& batch, uint64_t number) {
  const auto& layer = model_.layer(batch.layer_id);
  const int64_t out_features = result_features(layer, batch.op);
  std::vector<at::Tensor> inputs;
  for (auto& r : batch.requests) {
    auto& w = r.payload;
    inputs.push_back(w.channel->input(w.header, layer.dtype, {w.header.tokens, w.header.features}));
    w.destination = w.channel->destination(w.header, layer.dtype, {w.header.tokens, out_features});
    // [Input observer]
    if (on_input_ && inputs.back().defined()) on_input_(number, r.client_id, layer, batch.op, inputs.back());
  }
  return inputs;
}

// [Batch data path]
// Inputs: tcp payloads (ZeroMQ frames) and shm buffers are host memory; cuda-ipc buffers and NCCL receives are
// on the executor's GPU. On a GPU, host inputs are concatenated into one pinned buffer and copied
// up once, NCCL receives land straight in their rows of the batch, and one kernel packs every
// other part into it; the results go back the same way (one
// kernel writes each cuda-ipc client's rows into its buffer; host destinations are filled from the
// GPU by DMA). A batch of one request whose input and destination are both on the executor's
// device is computed straight from the client's buffer into the client's buffer, with no copy; so
// is a batch of such requests that are each large (kInPlaceTokens), one GEMM after another. A
// sharded executor's batches are always packed: the parts compute them together ([Rounds] in
// parts.h).
// Returns each request's result rows (views into the batch result, or its destination).
std::vector<at::Tensor> BatchRunner::compute(CallBatcher::Batch& batch) {
  auto& requests = batch.requests;
  if (cpu_cores_ > 0) {  // [CPU threads]
    const auto& layer = model_.layer(batch.layer_id);
    const int team = cpu_threads_for(batch.tokens, layer.in_features, layer.out_features,
                                     static_cast<int64_t>(c10::elementSize(layer.dtype)), cpu_cores_);
    if (team != at::get_num_threads()) at::set_num_threads(team);
  }
  const uint64_t number = ++batches_;
  std::vector<int64_t> first_row;
  at::Tensor y;
  if (parts_) {
    const RoundOffer offer{RoundOffer::kBatch, batch.layer_id, batch.op, batch.tokens,
                           requests[0].payload.header.features};
    y = parts_->compute(model_, parts_->rank(), offer,
                        [&] { return pack(batch, number, read_inputs(batch, number), first_row); });
  } else {
    const at::Device device = model_.device();
    const auto inputs = read_inputs(batch, number);
    // Requests that are read and written in place (CUDA IPC buffers) and each large enough to keep
    // the GPU busy alone run one GEMM each, straight from and into the clients' buffers: packing
    // them would add two copies of every row and gain nothing.
    bool in_place = true;
    for (size_t i = 0; i < requests.size() && in_place; ++i) {
      const auto& w = requests[i].payload;
      in_place = w.destination.defined() && w.destination.device() == device && inputs[i].defined() &&
                 inputs[i].device() == device && (requests.size() == 1 || w.header.tokens >= kInPlaceTokens);
    }
    if (in_place) {
      std::vector<at::Tensor> rows;
      for (size_t i = 0; i < requests.size(); ++i) {
        auto& w = requests[i].payload;
        const auto compute = [&] { compute_in_pieces(batch.layer_id, batch.op, inputs[i], w.destination); };
        if (w.channel->compute_replayed(w.header, inputs[i], w.destination, share_.variant(), compute)) {
          statistics_.replayed_calls++;
        } else {
          compute();
        }
        rows.push_back(w.destination);
      }
      return rows;
    }
#ifdef SYMBIOSIS_WITH_CUDA
    if (replays_ && replays_->run(batch, inputs)) {
      statistics_.replayed_calls += requests.size();
      std::vector<at::Tensor> rows;
      for (const auto& r : requests) rows.push_back(r.payload.destination);
      return rows;
    }
#endif
    y = model_.compute(batch.layer_id, batch.op, pack(batch, number, inputs, first_row));
  }
  std::vector<at::Tensor> rows;
  for (size_t i = 0; i < requests.size(); ++i)
    rows.push_back(y.narrow(0, first_row[i], requests[i].payload.header.tokens));
  return rows;
}

void BatchRunner::compute_in_pieces(uint32_t layer_id, LayerOp op, const at::Tensor& x, at::Tensor& out) const {
  const int64_t rows = x.size(0), piece_rows = share_.piece_rows;
  if (piece_rows <= 0 || rows <= piece_rows) return model_.compute_into(layer_id, op, x, out);
  for (int64_t row = 0; row < rows; row += piece_rows) {
    const int64_t count = std::min<int64_t>(piece_rows, rows - row);
    auto piece = out.narrow(0, row, count);
    model_.compute_into(layer_id, op, x.narrow(0, row, count), piece);
  }
}

at::Tensor BatchRunner::pack(CallBatcher::Batch& batch, uint64_t number, const std::vector<at::Tensor>& inputs,
                             std::vector<int64_t>& first_row) {
  const at::Device device = model_.device();
  auto& requests = batch.requests;
  const auto& layer = model_.layer(batch.layer_id);
  const int64_t features = requests[0].payload.header.features;
  auto on_device = [&](size_t i) { return !inputs[i].defined() || inputs[i].device() == device; };
  // Each request's first row in the batch: on a GPU, host inputs come first (one upload), device
  // inputs after them; the order of rows inside a batch is free.
  first_row.assign(inputs.size(), 0);
  std::vector<at::Tensor> host_inputs;
  int64_t host_tokens = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (on_device(i)) continue;
    host_inputs.push_back(inputs[i]);
    host_tokens += inputs[i].size(0);
  }
  int64_t host_row = 0, device_row = host_tokens;
  for (size_t i = 0; i < inputs.size(); ++i) {
    int64_t& next = on_device(i) ? device_row : host_row;
    first_row[i] = next;
    next += requests[i].payload.header.tokens;
  }
  const auto options = at::TensorOptions().dtype(layer.dtype).device(device);
  at::Tensor x;
  if (host_inputs.size() == 1 && host_inputs[0].is_pinned()) {
    x = host_inputs[0].to(device, /*non_blocking=*/true);  // a pinned shm buffer: DMA straight from it
  } else if (!host_inputs.empty()) {
    // ZeroMQ payloads sit in pageable frames: staged through one pinned buffer.
    auto pinned = at::empty({host_tokens, features}, options.device(at::kCPU).pinned_memory(device.is_cuda()));
    at::cat_out(pinned, host_inputs, 0);
    x = pinned.to(device, /*non_blocking=*/true);
  }
  if (inputs.size() == 1 && inputs[0].defined() && on_device(0)) {
    x = inputs[0];  // a single device input is used as it is
  } else if (host_inputs.size() < inputs.size()) {
    // Device inputs: received straight into the batch, or packed into it by one kernel (with the
    // uploaded host block).
    auto packed = at::empty({batch.tokens, features}, options);
    std::vector<at::Tensor> sources, targets;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!on_device(i)) continue;
      auto rows = packed.narrow(0, first_row[i], requests[i].payload.header.tokens);
      if (inputs[i].defined()) {
        sources.push_back(inputs[i]);
        targets.push_back(rows);
      } else {
        requests[i].payload.channel->receive_into(requests[i].payload.header, rows);
        if (on_input_) on_input_(number, requests[i].client_id, layer, batch.op, rows);  // [Input observer]
      }
    }
    if (!host_inputs.empty()) {
      sources.push_back(x);
      targets.push_back(packed.narrow(0, 0, host_tokens));
    }
    if (!sources.empty()) copy_rows(sources, targets);
    x = packed;
  }
  return x;
}

void BatchRunner::refuse(CallBatcher::Batch& batch, const Status& status) {
  for (auto& r : batch.requests) {
    statistics_.record_error(status.code(), r.client_id, batch.layer_id);
    r.payload.channel->refuse(r.payload.header, status);
  }
}

void BatchRunner::deliver(CallBatcher::Batch& batch, std::vector<at::Tensor>& results) {
  auto& requests = batch.requests;
  const bool gpu = model_.device().is_cuda();
  // 1. Results that go to a destination: one kernel for those on the GPU, copies for host ones.
  std::vector<at::Tensor> sources, targets;
  bool host_copies = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto& w = requests[i].payload;
    const auto& destination = w.destination;
    if (!destination.defined()) {
      w.channel->deliver(w.header, results[i]);  // NCCL
    } else if (destination.data_ptr() != results[i].data_ptr()) {
      if (destination.is_cuda()) {
        sources.push_back(results[i]);
        targets.push_back(destination);
      } else {
        destination.copy_(results[i], /*non_blocking=*/true);
        host_copies = host_copies || gpu;
      }
    }
  }
  if (!sources.empty()) copy_rows(sources, targets);
  // 3. Make the writes visible: GPU clients order on events or flags; host memory needs the GPU done.
  for (auto& r : requests) r.payload.channel->finish_writes(r.payload.header);
#ifdef SYMBIOSIS_WITH_CUDA
  if (host_copies) cuda::synchronize_stream(cuda::current_stream(model_.device().index()));
#endif
  // 4. Replies.
  for (auto& r : requests) {
    statistics_.requests++;
    statistics_.tokens += r.tokens;
    r.payload.channel->computed(r.payload.header);
    r.payload.channel->reply(r.payload.header);
  }
}

void BatchRunner::run(CallBatcher::Batch& batch, const GpuShare& share) {
  share_ = share;
  // [Traces] (tracing.h): the batch's scope names its calls; built only while a profiler listens.
  std::string scope;
  at::RecordFunction guard(at::RecordScope::USER_SCOPE);
  if (guard.isActive()) {
    scope = batch_scope_name(batch, model_.layer(batch.layer_id).name);
    guard.before(scope);
  }
  const auto started = Statistics::Clock::now();
  std::vector<at::Tensor> results;
  std::optional<Status> failure;
  try {
    results = compute(batch);
  } catch (const std::exception& e) {
    failure = parts_ && parts_->lost() ? *parts_->lost() : status_of_exception(e, StatusCode::kInternal);
  }
  const auto computed = Statistics::Clock::now();
  try {
    if (failure) {
      refuse(batch, *failure);
    } else {
      deliver(batch, results);
    }
  } catch (const std::exception& e) {
    spdlog::error("failed delivering a batch of layer {}: {}", batch.layer_id, e.what());
  }
  const auto finished = Statistics::Clock::now();
  calls_.clear();
  for (const auto& r : batch.requests) {
    calls_.push_back({r.client_id, r.tokens, r.latency, std::chrono::duration<double>(started - r.arrival).count()});
  }
  statistics_.record_batch(batch.layer_id, batch.op == LayerOp::kBackwardInput, calls_, !failure, started, computed,
                           finished);
}

}  // namespace symbiosis
