#pragma once
// The executor's scheduler: the one thread that computes. It alone owns the Batcher and the
// clients' channels, and everything reaches it through one inbox (post), which the front door
// feeds: clients joining and leaving, calls that came over ZeroMQ, payload set-up. Calls of
// clients on this host come straight through their channels' rings, which it polls
// ([Shared-memory control channel] in transport/call_ring.h). Each turn of its loop it empties
// the inbox, polls the channels, finishes NCCL set-ups, and runs the next batch the Batcher gives
// ([Opportunistic batching]) through the BatchRunner; with nothing to do it spins, then sleeps in
// poll() on its inbox's socket and every same-host client's ([Wake sockets] in transport/call_ring.h).
// Thread safety: post() and stop() from any thread; run() on the scheduler's thread.
#include <atomic>
#include <deque>
#include <chrono>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <poll.h>
#include <zmq.hpp>

#include "base_executor/base_model.h"
#include "base_executor/batch_runner.h"
#include "base_executor/run_gathering.h"
#include "base_executor/executor.h"
#include "base_executor/gpu_share.h"
#include "base_executor/overload.h"
#include "base_executor/parts.h"
#include "base_executor/statistics.h"
#include "base_executor/teardown.h"
#include "base_executor/tracing.h"
#include "symbiosis.pb.h"
#include "transport/channel.h"

namespace symbiosis {

// What the front door posts to the scheduler.
struct ClientJoined {
  std::shared_ptr<Channel> channel;
  std::string tenant;  // [Fair shares] (overload.h): its key's name under --keys; "" (a tenant of its own) without
};
struct ClientLeft {
  uint64_t client_id;
};
// [Admission]: a same-host client whose key is no longer admitted. Its calls, which come through
// its control segment where the front door cannot refuse them, are refused with `why` until it
// leaves.
struct ClientRefused {
  uint64_t client_id;
  Status why;
};
// A call whose header came over ZeroMQ (tcp, or a client whose control is ZeroMQ), with the
// payload frames that followed it (tcp).
struct CallArrived {
  std::shared_ptr<Channel> channel;
  shm::CallHeader header;
  std::vector<int64_t> shape;
  std::vector<zmq::message_t> frames;
};
// RegisterBuffer, ShareSegments or NcclSetup from the client `identity` routes to.
struct SetupArrived {
  std::shared_ptr<Channel> channel;
  proto::Envelope envelope;
  std::string identity;
  UniqueFd segment;  // "shm": the RegisterBuffer's segment, from the client's local link
};
// [Traces] (tracing.h): an operator's TraceRequest, answered to `identity`.
struct TraceArrived {
  proto::TraceRequest request;
  std::string identity;
};
using InboxMessage = std::variant<ClientJoined, ClientLeft, ClientRefused, CallArrived, SetupArrived, TraceArrived>;

class Scheduler {
 public:
  // replies_endpoint: where answers to set-up messages go (the front door forwards them).
  // buffers: [Buffer budget], which payload buffers a client registers take from.
  // parts: a sharded executor's ([Parts] in parts.h), whose rounds the loop takes part in; null:
  // not sharded. on_lost: called once, on the scheduler's thread, when the parts are lost.
  Scheduler(const ExecutorOptions& options, const BaseModel& model, Statistics& statistics, BufferBudget& buffers,
            zmq::context_t& context, std::string replies_endpoint, Parts* parts = nullptr,
            std::function<void(const Status&)> on_lost = {});
  ~Scheduler();

  void post(InboxMessage message);
  // Posts a call that came over ZeroMQ, unless its tokens would bring the calls waiting (in the
  // inbox and the Batcher) past --max-queued-tokens and its client past its share of them ([Fair
  // shares] in overload.h): then it returns the refusal and posts nothing.
  Status post_call(CallArrived call);
  // The loop; returns once stop() was called.
  void run();
  void stop();

 private:
  void handle(ClientJoined& message);
  void handle(ClientLeft& message);
  void handle(ClientRefused& message);
  void handle(CallArrived& message);
  void handle(SetupArrived& message);
  void handle(TraceArrived& message);
  // [Fair shares] of the buffer budget: what the client's tenant holds of it, among the tenants
  // holding payload buffers.
  PoolShare buffer_share(uint64_t client_id) const;
  // Checks a call and queues it, or refuses it through its channel. `admitted`: post_call() has
  // counted its tokens already ([Fair shares]); a call through a channel is checked against them here.
  void accept(const std::shared_ptr<Channel>& channel, shm::CallHeader h, const std::vector<int64_t>& shape,
              bool admitted = false);
  // Takes the channels' new calls and pushes the replies they held; true while a reply is still
  // held or a call waits for its client's GPU to write its input: the loop then looks again at once.
  bool poll_channels();
  // [Runs launched together]: launches the ready runs, each (client, its run's signature), alone or
  // together as gathering_ decides; those it holds for others are ready again at the next look.
  void launch_ready_runs(const std::vector<std::pair<uint64_t, uint64_t>>& ready);
  // [Steps launched ahead]: launches the channel's run if its calls begin with one.
  void launch_if_ready(Channel& channel);
  // Launches the ready runs of `together` (one channel: alone) and counts their calls.
  void launch(const std::vector<Channel*>& together);
  bool launches_ahead() const;  // whether runs are launched ahead here
  void finish_setups();
  // [Wake sockets]: spins for `spin` until something was posted since `seen_posts` or a client pushed
  // a call, then sleeps in poll() until then; returns by `deadline` at the latest.
  void wait_for_work(uint32_t seen_posts, std::chrono::nanoseconds spin,
                     std::chrono::steady_clock::time_point deadline);
  // Wakes the inbox's socket if the scheduler sleeps (after posts_ changed).
  void wake_if_sleeping();
  void answer_error(const std::string& identity, uint64_t client_id, const Status& status);
  // Publishes the Batcher's pending calls and tokens (for the queue's shares and the statistics).
  void note_queue();
  // [Paying waits] (batching.h): the judge's verdict, logged when it changes.
  void note_judge();
  std::optional<bool> judged_;
  // [Rounds] (parts.h): one round of the parts, offering `batch`; true when any part had a batch.
  bool take_part(std::optional<CallBatcher::Batch>& batch);
  // [Lost part]: refuses every call held, and from now on every new one, with `why`.
  void lose(const Status& why);

  const ExecutorOptions& options_;
  const BaseModel& model_;
  Statistics& statistics_;
  zmq::context_t& context_;
  const std::string replies_endpoint_;
  std::atomic<bool> stopping_{false};
  // [Wake sockets]: post() counts what it posts and sends to inbox_wake_ while the scheduler sleeps.
  std::atomic<uint32_t> posts_{0};
  std::atomic<bool> sleeping_{false};
  shm::WakeSocket inbox_wake_;

  BufferBudget& buffers_;

  std::mutex inbox_mutex_;
  std::vector<InboxMessage> inbox_;  // guarded by inbox_mutex_
  // [Fair shares] (overload.h): tokens of the CallArrived in the inbox by client (post_call
  // admits, the scheduler takes them out), and of the calls in the Batcher (published by the
  // scheduler's thread alone, in note_queue).
  QueueShares queue_shares_;

  // Owned by the scheduler's thread.
  CallBatcher batcher_;
  BatchRunner runner_;
  RunGathering gathering_;
  // [GPU share] (gpu_share.h): when a decode call came or a decode step was ready last.
  std::chrono::steady_clock::time_point last_decode_{};
  std::map<uint64_t, std::shared_ptr<Channel>> channels_;  // every client's, by id
  Teardown teardown_;                   // of the channels it lets go of ([Teardown off the front door] in teardown.h)
  std::map<uint64_t, Status> refused_;  // ClientRefused: why, by client id
  std::map<uint64_t, uint64_t> buffer_bytes_;  // [Buffer budget]: each client's registered buffer
  std::map<uint64_t, std::string> tenants_;    // [Fair shares]: ClientJoined's tenant, by client id
  struct PendingSetup {                        // [Transport set-up] not yet finished
    std::shared_ptr<Channel> channel;
    std::string identity;    // the client's ZeroMQ routing id
    proto::Envelope answer;  // what the channel's set_up answered, sent once setup_done()
  };
  std::vector<PendingSetup> pending_setups_;  // set-ups still going on (NCCL communicators joining)
  // [No waits on a client] (transport/cuda_ipc/cuda_ipc_channel.cpp): calls over ZeroMQ whose input
  // the client has not written yet, oldest first.
  std::deque<CallArrived> held_calls_;
  std::vector<pollfd> sleep_fds_;           // [Wake sockets]: kept between sleeps
  std::vector<Channel*> sleep_channels_;    // the channel of each of sleep_fds_ (the inbox's: none)
  std::unique_ptr<zmq::socket_t> replies_;  // answers to set-up messages, to the front door
  Parts* const parts_;
  const std::function<void(const Status&)> on_lost_;
  std::optional<Status> lost_;  // [Lost part]
  Tracer tracer_;               // [Traces]
};

}  // namespace symbiosis
