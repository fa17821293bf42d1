#include "base_executor/scheduler.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "base_executor/call_check.h"
#include "common/cuda.h"
#include "common/slow_scope.h"
#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/direct_gemm.h"
#endif
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;
// [Rounds] (parts.h): how long an idle part of a sharded executor waits for work before its next
// round: a part with work waits up to this for the others.
constexpr auto kRoundWait = std::chrono::microseconds(500);

#ifdef SYMBIOSIS_WITH_CUDA
// One GEMM of the first layer on each compute stream, before any client's: the GEMM library's
// handle and workspace of each stream, and its first allocations, are made now, so the executor's
// memory does not grow with the number of clients whose batches use the streams.
void warm_up(BatchRunner& runner, cuda::ComputeStreams& streams, int count) {
  for (const bool yield : {false, true}) {
    for (int i = 0; i < count; ++i) {
      streams.use(i, yield);
      runner.warm_up_stream();
    }
  }
  streams.use(0);
}
#endif

}  // namespace

Scheduler::Scheduler(const ExecutorOptions& options, const BaseModel& model, Statistics& statistics,
                     BufferBudget& buffers, zmq::context_t& context, std::string replies_endpoint, Parts* parts,
                     std::function<void(const Status&)> on_lost)
    : options_(options),
      model_(model),
      statistics_(statistics),
      context_(context),
      replies_endpoint_(std::move(replies_endpoint)),
      buffers_(buffers),
      queue_shares_(options.max_queued_tokens),
      batcher_(options.batching),
      runner_(model, statistics, options.on_input, parts),
      gathering_({.together = options.launch_together && options.batching.policy == BatchingPolicy::kOpportunistic,
                  .wait = options.launch_together_wait,
                  .max_members = options.launch_together_max,
                  .from = options.launch_together_from}),
      parts_(parts),
      on_lost_(std::move(on_lost)) {}

Scheduler::~Scheduler() {
  // Nothing may wait on a client that is gone (NCCL kernels).
  for (auto& [id, channel] : channels_) channel->abort();
}

void Scheduler::post(InboxMessage message) {
  // [Fair shares]: a client's calls count for its tenant from the first, which post_call() may
  // admit before this thread handles the join.
  if (auto* joined = std::get_if<ClientJoined>(&message))
    queue_shares_.join(joined->channel->client_id(), joined->tenant);
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    inbox_.push_back(std::move(message));
  }
  wake_if_sleeping();
}

void Scheduler::wake_if_sleeping() {
  posts_.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // [Wake sockets]: the post before the look
  if (sleeping_.load(std::memory_order_seq_cst)) shm::wake(inbox_wake_.writer());
}

namespace {

// The tokens a call over ZeroMQ claims, as counted in the inbox: its shape's rows where the shape
// is [tokens, features] (any other is refused by the call check).
int64_t claimed_tokens(const CallArrived& call) {
  return call.shape.size() == 2 && call.shape[0] > 0 ? call.shape[0] : 0;
}

}  // namespace

Status Scheduler::post_call(CallArrived call) {
  // [Fair shares]: counted while it waits in the inbox; into an empty share, any call.
  auto admitted = queue_shares_.admit(call.channel->client_id(), call.header.request_id, claimed_tokens(call));
  if (admitted.is_ok()) post(std::move(call));
  return admitted;
}

void Scheduler::note_queue() {
  queue_shares_.note_batched(batcher_.pending_tokens_by_client());
  statistics_.queue_depth = batcher_.pending();
  statistics_.queued_tokens = batcher_.pending_tokens();
}

void Scheduler::note_judge() {
  const auto better = batcher_.judge().better();
  if (!better || better == judged_) return;
  judged_ = better;
  const auto& judge = batcher_.judge();
  spdlog::info(
      "decode calls now {} for companions: {:.0f} decode calls a second were served with waits, {:.0f} "
      "without ([Paying waits])",
      *better ? "wait" : "do not wait", judge.rate(true), judge.rate(false));
}

void Scheduler::stop() {
  stopping_ = true;
  wake_if_sleeping();
}

void Scheduler::handle(ClientJoined& message) {
  const uint64_t id = message.channel->client_id();
  channels_[id] = std::move(message.channel);
  tenants_[id] = std::move(message.tenant);
  batcher_.add_client(id);
}

void Scheduler::handle(ClientLeft& message) {
  const uint64_t id = message.client_id;
  batcher_.remove_client(id);  // lockstep queues may be ready now
  std::erase_if(pending_setups_, [id](const PendingSetup& p) { return p.channel->client_id() == id; });
  if (const auto it = channels_.find(id); it != channels_.end()) {
    teardown_.hand_over(std::move(it->second));  // [Teardown off the front door] (teardown.h)
    channels_.erase(it);
  }
  refused_.erase(id);
  tenants_.erase(id);
  queue_shares_.leave(id);
  if (const auto it = buffer_bytes_.find(id); it != buffer_bytes_.end()) {
    buffers_.give_back(it->second);
    buffer_bytes_.erase(it);
  }
}

void Scheduler::handle(ClientRefused& message) {
  batcher_.remove_client(message.client_id);
  refused_[message.client_id] = std::move(message.why);
}

void Scheduler::handle(CallArrived& message) {
  const uint64_t client_id = message.channel->client_id();
  const int64_t tokens = claimed_tokens(message);
  if (message.channel->payload_in_frames()) message.channel->receive_frames(message.header, std::move(message.frames));
  // [No waits on a client] (transport/cuda_ipc/cuda_ipc_channel.cpp): held until its input is written.
  if (!message.channel->input_written(message.header)) {
    queue_shares_.leave_inbox(client_id, tokens);
    held_calls_.push_back(std::move(message));
    return;
  }
  // [Fair shares]: the call leaves the inbox's count only once the Batcher's count holds it
  // (accept() publishes it), so that the front door never sees its client hold nothing meanwhile
  // and lets a call past its share in.
  accept(message.channel, message.header, message.shape, /*admitted=*/true);
  queue_shares_.leave_inbox(client_id, tokens);
}

PoolShare Scheduler::buffer_share(uint64_t client_id) const {
  // A client without a tenant (no --keys) is one of its own.
  auto tenant_of = [this](uint64_t id) {
    const auto it = tenants_.find(id);
    return it != tenants_.end() && !it->second.empty() ? std::pair<std::string, uint64_t>{it->second, 0}
                                                       : std::pair<std::string, uint64_t>{"", id};
  };
  std::map<std::pair<std::string, uint64_t>, uint64_t> by_tenant;
  for (const auto& [id, bytes] : buffer_bytes_) {
    if (bytes > 0) by_tenant[tenant_of(id)] += bytes;
  }
  const auto mine = by_tenant.find(tenant_of(client_id));
  const uint64_t held = mine != by_tenant.end() ? mine->second : 0;
  return {held, by_tenant.size() + (held == 0 ? 1 : 0)};
}

void Scheduler::handle(SetupArrived& message) {
  auto& channel = *message.channel;
  const auto& env = message.envelope;
  const uint64_t id = channel.client_id();
  // [Slow scopes]: work here that waits for the GPU holds every client's calls meanwhile.
  const SlowScope slow("client " + std::to_string(id) + ": its set-up message on the scheduler's thread");
  try {
    proto::Envelope answer;
    if (env.has_register_buffer()) {
      // [Buffer budget]: the new buffer replaces the client's last; only what it adds is taken, by
      // [Fair shares] among the tenants holding payload buffers.
      const uint64_t bytes = env.register_buffer().bytes(), held = buffer_bytes_[id];
      const uint64_t more = bytes > held ? bytes - held : 0;
      if (auto status = buffers_.take(more, "registering a payload buffer", buffer_share(id)); !status.is_ok()) {
        return answer_error(message.identity, id, status);
      }
      try {
        *answer.mutable_buffer_registered() =
            channel.register_buffer(env.register_buffer(), std::move(message.segment));
      } catch (...) {
        buffers_.give_back(more);
        throw;
      }
      if (bytes < held) buffers_.give_back(held - bytes);
      buffer_bytes_[id] = bytes;
    } else {
      answer = channel.set_up(env);  // [Transport set-up] (transport/channel.h): the plug-in's own
      if (!channel.setup_done()) {
        pending_setups_.push_back({message.channel, message.identity, std::move(answer)});
        return;  // answered once it is finished (finish_setups): an NCCL communicator joining
      }
    }
    wire::send_to(*replies_, message.identity, answer);
  } catch (const std::exception& e) {
    answer_error(message.identity, id, status_of_exception(e, StatusCode::kFailedPrecondition));
  }
}

// [Traces]: on this thread, where the batches run.
void Scheduler::handle(TraceArrived& message) {
  const auto& request = message.request;
  proto::Envelope answer;
  try {
    if (request.start()) {
      tracer_.start(request.path(), model_.device().is_cuda(), runner_.batches());
      answer.mutable_trace_written()->set_path(request.path());
    } else {
      answer.mutable_trace_written()->set_path(tracer_.path());
      answer.mutable_trace_written()->set_batches(tracer_.stop(runner_.batches()));
    }
  } catch (const std::exception& e) {
    // An operator's mistake, not a tenant's call: not counted among the errors.
    answer = wire::error_envelope(0, status_of_exception(e, StatusCode::kFailedPrecondition), /*as_reply=*/false);
  }
  wire::send_to(*replies_, message.identity, answer);
}

void Scheduler::answer_error(const std::string& identity, uint64_t client_id, const Status& status) {
  statistics_.record_error(status.code(), client_id);
  wire::send_to(*replies_, identity, wire::error_envelope(0, status, /*as_reply=*/false));
}

void Scheduler::accept(const std::shared_ptr<Channel>& channel, shm::CallHeader h, const std::vector<int64_t>& shape,
                       bool admitted) {
  if (h.latency_class != proto::INFERENCE_DECODE) gathering_.stopped_decoding(channel->client_id());
  const auto refused = refused_.find(channel->client_id());
  Status status = refused != refused_.end() ? refused->second
                  : lost_                   ? *lost_
                                            : check_call(model_, options_.max_request_bytes, *channel, h, shape);
  // [Fair shares] (overload.h): a call through a channel is refused when the queue is full and it
  // would take its client past its share; for cuda-ipc with [Stream-ordered hand-off] the refusal
  // reaches the client only at its next call, and voids this call's result.
  if (status.is_ok() && !admitted) status = queue_shares_.check(channel->client_id(), h.request_id, h.tokens);
  if (!status.is_ok()) {
    statistics_.record_error(status.code(), channel->client_id(),
                             h.layer_id < model_.layer_count() ? std::optional<uint32_t>(h.layer_id) : std::nullopt);
    channel->refuse(h, status);
    return;
  }
  if (h.in_segment != 0 || h.out_segment != 0) statistics_.direct_calls++;
  CallBatcher::Request queued;
  queued.client_id = channel->client_id();
  queued.layer_id = h.layer_id;
  queued.op = to_layer_op(h.op);
  queued.tokens = h.tokens;
  queued.latency = wire::latency_from_proto(h.latency_class);
  queued.arrival = Clock::now();
  if (h.latency_class == proto::INFERENCE_DECODE) last_decode_ = queued.arrival;
  const CallRows rows = channel->orders_by_flags()                ? CallRows::kInPlace
                        : channel->kind() == TransportKind::kNccl ? CallRows::kReceived
                                                                  : CallRows::kHost;
  // [Calls by themselves] (gpu_share.h)
  queued.alone = model_.device().is_cuda() && parts_ == nullptr &&
                 runs_by_itself(rows, h.tokens, options_.concurrent_tokens, options_.streams);
  if (batcher_.runs_alone(queued) && rows == CallRows::kInPlace) statistics_.concurrent_calls++;
  queued.payload.header = h;
  queued.payload.channel = channel;
  batcher_.push(std::move(queued));
  note_queue();
}

bool Scheduler::poll_channels() {
  bool holding = false;
  // [No waits on a client]: calls over ZeroMQ whose input was not written yet, in arrival order.
  for (auto it = held_calls_.begin(); it != held_calls_.end();) {
    auto& call = *it;
    if (call.channel->broken() || !channels_.count(call.channel->client_id())) {
      teardown_.hand_over(std::move(call.channel));  // its client left
      it = held_calls_.erase(it);
    } else if (!call.channel->input_written(call.header)) {
      holding = true;
      ++it;
    } else {
      accept(call.channel, call.header, call.shape, /*admitted=*/true);
      it = held_calls_.erase(it);
    }
  }
  const bool ahead = launches_ahead();
  // [Runs launched together] (under opportunistic): the channels' ready runs, launched after this
  // look, alone or together as gathering_ decides; without it, each channel's ready run is launched
  // where its calls are taken.
  const bool together = ahead && gathering_.together();
  std::vector<std::pair<uint64_t, uint64_t>> ready;  // (client, its run's signature)
  for (auto it = channels_.begin(); it != channels_.end();) {
    const auto& channel = it->second;
    holding = channel->release_replies() || holding;
    // A call is checked once its input is ready, so that a refusal, which releases the client's
    // stream ([Stream-ordered hand-off]), never overtakes the result of the call before it. A ready
    // run goes whole, never call by call: its channel's calls are taken at a later look, after it.
    const auto signature = together && !refused_.count(it->first) ? channel->run_ready() : std::nullopt;
    if (signature) {
      ready.emplace_back(it->first, *signature);
      holding = true;
    } else {
      if (ahead && !together) launch_if_ready(*channel);
      while (auto header = channel->next_request()) accept(channel, *header, {header->tokens, header->features});
    }
    holding = channel->waiting() || holding;
    if (!channel->broken()) {
      ++it;
      continue;
    }
    if (channel->faulted()) {
      spdlog::warn(
          "client {}: a touch of the memory it shares with the executor faulted ([Fault guard]); dropping "
          "the client",
          channel->client_id());
    }
    gathering_.forget(it->first);
    teardown_.hand_over(std::move(it->second));  // [Teardown off the front door] (teardown.h)
    it = channels_.erase(it);
  }
  if (!ready.empty()) launch_ready_runs(ready);
  return holding;
}

// [Steps launched ahead] (transport/cuda_ipc/cuda_ipc_channel.cpp). Not for a sharded executor (the
// parts compute every batch together), nor under lockstep (its batches wait for every client's
// call), nor while an [Input observer] must see each input. A refused client's calls go call by
// call, to be refused.
bool Scheduler::launches_ahead() const {
  return options_.launch_ahead && parts_ == nullptr && options_.batching.policy != BatchingPolicy::kLockstep &&
         !options_.on_input && !lost_;
}

void Scheduler::launch_ready_runs(const std::vector<std::pair<uint64_t, uint64_t>>& ready) {
  last_decode_ = Clock::now();  // runs are decode steps, whether launched now or held
  for (const auto& group : gathering_.decide(ready, last_decode_)) {
    std::vector<Channel*> together;
    for (const uint64_t id : group) {
      if (const auto it = channels_.find(id); it != channels_.end()) together.push_back(it->second.get());
    }
    if (!together.empty()) launch(together);
  }
}

void Scheduler::launch_if_ready(Channel& channel) {
  if (refused_.count(channel.client_id()) || !channel.run_ready()) return;
  launch({&channel});
}

void Scheduler::launch(const std::vector<Channel*>& together) {
  last_decode_ = Clock::now();  // runs are decode steps
  const auto launched = together[0]->launch_ahead(together, runner_);
  for (size_t i = 0; i < together.size(); ++i) {
    if (launched[i].empty()) continue;  // it goes call by call from now on
    std::vector<std::pair<uint32_t, int64_t>> counted;
    for (const auto& h : launched[i]) counted.emplace_back(h.layer_id, h.tokens);
    statistics_.record_ahead(together[i]->client_id(), wire::latency_from_proto(launched[i][0].latency_class), counted,
                             together.size() > 1);
  }
}

void Scheduler::finish_setups() {
  for (auto it = pending_setups_.begin(); it != pending_setups_.end();) {
    try {
      if (!it->channel->setup_done()) {
        ++it;
        continue;
      }
      wire::send_to(*replies_, it->identity, it->answer);
    } catch (const std::exception& e) {
      answer_error(it->identity, it->channel->client_id(), status_of_exception(e, StatusCode::kFailedPrecondition));
    }
    it = pending_setups_.erase(it);
  }
}

// [Rounds] (parts.h). The round's batches run in rank order, each on the first compute stream.
bool Scheduler::take_part(std::optional<CallBatcher::Batch>& batch) {
  if (lost_) return false;
  RoundOffer mine;
  if (batch) {
    mine = {RoundOffer::kBatch, batch->layer_id, batch->op, batch->tokens, batch->requests[0].payload.header.features};
  }
  bool any = false;
  try {
    const auto offers = parts_->exchange(mine);
    for (size_t part = 0; part < offers.size(); ++part) {
      if (offers[part].kind == RoundOffer::kLeaving) {
        lose(Status(StatusCode::kUnavailable, "executor part " + std::to_string(part) + " of " +
                                                  std::to_string(offers.size()) + " was stopped; " + parts_->name() +
                                                  " stops with it"));
        break;
      }
    }
    for (size_t part = 0; part < offers.size() && !lost_; ++part) {
      if (offers[part].kind != RoundOffer::kBatch) continue;
      any = true;
      if (static_cast<int>(part) == parts_->rank()) {
        runner_.run(*batch);  // refuses the batch's calls itself if the parts are lost meanwhile
        batch.reset();
      } else {
        parts_->compute(model_, static_cast<int>(part), offers[part], {});
      }
    }
  } catch (const std::exception& e) {
    // Any failure here leaves the parts out of step: none can serve on.
    if (!lost_) {
      lose(parts_->lost()
               ? *parts_->lost()
               : Status(StatusCode::kUnavailable, "executor " + parts_->name() + " failed in a round: " +
                                                      status_of_exception(e, StatusCode::kInternal).message() +
                                                      "; this sharded executor stops"));
    }
  }
  if (parts_->lost() && !lost_) lose(*parts_->lost());
  if (batch && lost_) runner_.refuse(*batch, *lost_);
  return any;
}

void Scheduler::lose(const Status& why) {
  spdlog::error("{}", why.message());
  lost_ = why;
  for (auto& batch : batcher_.drain()) runner_.refuse(batch, why);
  note_queue();
  if (on_lost_) on_lost_(why);
}

void Scheduler::run() {
  // OpenMP's thread count and the current CUDA device are per thread: set them where we compute.
  if (options_.threads > 0) {
    at::set_num_threads(options_.threads);
  } else if (model_.device().is_cpu()) {
    runner_.size_cpu_teams(at::get_num_threads());  // [CPU threads]
  }
#ifdef SYMBIOSIS_WITH_CUDA
  std::optional<cuda::ComputeStreams> streams;
  if (model_.device().is_cuda()) {
    streams.emplace(model_.device().index(), options_.streams);
    warm_up(runner_, *streams, options_.streams);
  }
#endif
  // Nothing here is differentiated: skip autograd's bookkeeping on every operation.
  c10::InferenceMode inference_mode;
  replies_ = std::make_unique<zmq::socket_t>(context_, zmq::socket_type::push);
  replies_->set(zmq::sockopt::linger, 0);
  replies_->connect(replies_endpoint_);
  const auto spin = std::chrono::microseconds(options_.spin_us >= 0 ? options_.spin_us
                                                                    : shm::default_spin_us(model_.device().is_cuda()));
  while (!stopping_) {
    // Anything posted after this read wakes the wait below ([Wake sockets]).
    const uint32_t seen = posts_.load();
    std::vector<InboxMessage> messages;
    {
      std::lock_guard<std::mutex> lock(inbox_mutex_);
      messages.swap(inbox_);
    }
    for (auto& message : messages) std::visit([this](auto& m) { handle(m); }, message);
    finish_setups();
    const bool watching = poll_channels();
    const auto now = Clock::now();
    auto batch = batcher_.pop(now);
    note_queue();
    note_judge();
    if (parts_) {
      if (take_part(batch)) continue;
    } else if (batch) {
      GpuShare share;  // [GPU share] (gpu_share.h): whole, on all the multiprocessors
#ifdef SYMBIOSIS_WITH_CUDA
      if (streams) {
        const auto& first = batch->requests[0];
        const bool fine_tuning = std::all_of(batch->requests.begin(), batch->requests.end(),
                                             [](const auto& r) { return r.latency == LatencyClass::kFineTuning; });
        share = gpu_share(fine_tuning, now - last_decode_, options_.finetune_sm_percent, options_.finetune_piece_rows);
        if (share.yields()) statistics_.yielding_calls += batch->requests.size();
        // [Compute streams]: in place on the client's stream, or on the first
        const bool in_place = batch->requests.size() == 1 && first.payload.channel->orders_by_flags();
        streams->use(in_place ? first.client_id : 0, in_place && share.low_priority);
      }
      cuda::GemmSmTarget sms(share.sm_percent);
#endif
      runner_.run(*batch, share);
      continue;
    }
    auto deadline = batcher_.next_deadline(now);
    if (!pending_setups_.empty()) deadline = std::min(deadline, now + std::chrono::milliseconds(1));
    // [Rounds]: the other parts wait for this one's next offer.
    if (parts_ && !lost_) deadline = std::min(deadline, now + kRoundWait);
    if (watching) continue;  // a result or an input about to be ready: look again at once
    wait_for_work(seen, spin, deadline);
  }
  if (parts_) parts_->leave();
  if (tracer_.active()) {  // [Traces]: stopping the executor loses no trace
    try {
      tracer_.stop(runner_.batches());
    } catch (const std::exception& e) {
      spdlog::error("writing the trace to {} failed: {}", tracer_.path(), e.what());
    }
  }
}

// [Wake sockets] (transport/call_ring.h)
void Scheduler::wait_for_work(uint32_t seen_posts, std::chrono::nanoseconds spin, Clock::time_point deadline) {
  auto work_came = [&] {
    if (posts_.load() != seen_posts || stopping_) return true;
    for (const auto& [id, channel] : channels_) {
      if (channel->has_request()) return true;
    }
    return false;
  };
  const auto spin_until = std::min(deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(spin));
  for (uint32_t i = 0;; ++i) {
    if (work_came()) return;
    if ((i & 63) == 0 && Clock::now() >= spin_until) break;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  if (Clock::now() >= deadline) return;
  // Every waker hears that the scheduler sleeps before it looks once more.
  sleeping_.store(true, std::memory_order_seq_cst);
  for (const auto& [id, channel] : channels_) channel->executor_sleeps(true);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!work_came()) {
    sleep_fds_.assign({{inbox_wake_.reader(), POLLIN, 0}});
    sleep_channels_.assign({nullptr});
    for (const auto& [id, channel] : channels_) {
      if (channel->wake_descriptor() < 0) continue;
      sleep_fds_.push_back({channel->wake_descriptor(), POLLIN, 0});
      sleep_channels_.push_back(channel.get());
    }
    // At most a second at a time: nothing depends on it, but a stuck sleep would show as one.
    const auto left =
        std::clamp<Clock::duration>(deadline - Clock::now(), Clock::duration::zero(), std::chrono::seconds(1));
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    const timespec timeout{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    if (::ppoll(sleep_fds_.data(), sleep_fds_.size(), &timeout, nullptr) > 0) {
      for (size_t i = 0; i < sleep_fds_.size(); ++i) {
        const short woken = sleep_fds_[i].revents;
        if (woken == 0) continue;
        shm::drain(sleep_fds_[i].fd);  // so that the next sleep sleeps
        // A client that closed its end would wake every sleep from now on: it is polled no more.
        if ((woken & (POLLERR | POLLHUP | POLLNVAL)) != 0 && sleep_channels_[i] != nullptr) {
          sleep_channels_[i]->stop_wakes();
        }
      }
    }
  }
  sleeping_.store(false, std::memory_order_seq_cst);
  for (const auto& [id, channel] : channels_) channel->executor_sleeps(false);
}

}  // namespace symbiosis
