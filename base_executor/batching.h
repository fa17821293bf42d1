#pragma once
// [Opportunistic batching]
// Requests for the same (layer, op) from different clients are concatenated along the token
// dimension, padding-free, and run as one GEMM. The Batcher keeps one FIFO queue per (layer, op)
// and decides, for a given time, which queue runs next and which of its requests go together.
// Three policies sit behind one switch:
//  - kNone: every request alone, the globally oldest first.
//  - kLockstep: a queue runs once it holds a request from every client in the lockstep set.
//    A client that leaves is removed; when the oldest request has waited lockstep_timeout, the
//    clients still missing are dropped from the set (re-added at their next request), so a
//    stalled or dead client never deadlocks the others.
//    [Lockstep catch-up]: clients out of step (one came a call later than the others, as a GPU
//    client does whose set-up took longer) each wait in their own queue for the others, who
//    cannot come: a client's next call follows its last one's result. So once every client of the
//    set has a request queued and no queue holds them all, the queue holding the fewest requests
//    (of those, the one whose latest request is youngest) runs: its clients, behind the others,
//    catch up with them, and the others wait for them where they are. Without it, each such round
//    waited out the timeout and the clients stayed out of step: every round of
//    PackedBatchTest on a GPU did (tests/base_executor/gpu_executor_test.cpp).
//  - Any policy but lockstep: a request marked `alone` bypasses the queues and runs by itself as
//    soon as it is the oldest ready work (see [Compute streams] in common/cuda.h: the
//    executor marks large same-GPU requests, whose GEMMs run best side by side, unpacked).
//  - kOpportunistic (default): each request may wait for companions until its own deadline,
//    arrival + min(max_wait, class_wait + per_token_wait * tokens). A queue runs when its earliest
//    deadline passes (so a small decode request is never held behind a large fine-tuning one: it
//    takes them along when it leaves), when it holds max_batch_tokens, or when no companion is
//    expected. A companion is a client, not yet in the queue, whose next request is predicted to
//    come here: each client walks the layers in the same order every iteration, so the Batcher
//    learns, per client, which queue followed which, and predicts the client's next queue from
//    its last one. Only clients active within the last companion_window count (one that went
//    quiet is not waited for). Clients whose paths do not cross a queue soon thus do not wait for
//    each other at all, while clients moving through the layers together batch.
//    [Decode alignment]: inference tenants decode through the same layers, but each at its own
//    phase (one prefilled, another's attention is longer), and tenants out of step by more than a
//    call never meet: every one of their steps reads all the weights alone. So a decode call that
//    starts a step (its client's first queue, learnt as the first it ever came to) is a rendezvous:
//    it waits, up to decode_align_wait, for every active decode client that has been there, wherever
//    it is now. Released together, the tenants then meet at every call of the step (each is the
//    others' predicted companion), one GEMM for all, and stay in step, since a batch answers all its
//    calls at once. A tenant out of step (back from a prefill, which is not decode) waits at most a
//    step for the others; the others wait for nobody who is not decoding. The wait should be at
//    least half a step: two tenants whose phases differ by more than the wait can miss each other
//    at every rendezvous.
//    [Paying waits]: whether decode requests should wait for companions at all is not known in
//    advance: packing reads a layer's weights once for many tenants, but tenants held in step also
//    run their own kernels at the same moments instead of beside each other's GEMMs, and a packed
//    call waits for the slowest tenant of its batch (measured on GPUs: tenants in step decoded
//    slower than tenants that never waited, and packing even the calls that happened to queue
//    together cost 14% against `none` at 8 tenants on an H200, their GEMMs no longer side by side
//    on the tenants' streams). So the WaitJudge measures it: over windows of judge_window, it
//    counts the decode requests served per second with decode waits on (the budgets and the
//    rendezvous above) and with them off (decode runs as under `none`: at once, a request a batch),
//    keeps the better, and tries the other one window in judge_explore_every (eight times as seldom
//    while the other is behind by a fifth or more: each try of a far worse way costs throughput), so the choice follows the workload. The first
//    part of a window after a switch, while the tenants fall into or out of step, is not counted.
// Every policy: a batch takes requests oldest first up to max_batch_tokens (at least one), and
// among ready queues the one whose oldest request is oldest runs first, so no queue starves.
// [Inference first]: except that when ready work holds an inference decode request and other ready
// work is older, the decode work goes first (the oldest such), at most decode_first_streak batches
// in a row; then the oldest work runs, so fine-tuning keeps a bounded share (at least one batch in
// decode_first_streak + 1) however much decoding comes.
// The Batcher is a plain data structure with an explicit clock: thread safety is the caller's
// (the executor guards it with one mutex), and tests drive it with a fake clock.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base_executor/base_model.h"
#include "common/layer_info.h"

namespace symbiosis {

enum class BatchingPolicy { kNone, kLockstep, kOpportunistic };

BatchingPolicy parse_batching_policy(const std::string& name);  // "none" | "lockstep" | "opportunistic"
const char* batching_policy_name(BatchingPolicy policy);

struct BatchingOptions {
  BatchingPolicy policy = BatchingPolicy::kOpportunistic;
  std::chrono::microseconds max_wait{2000};            // no request waits longer for companions
  int64_t max_batch_tokens = 16384;                    // a batch closes at this many tokens
  std::chrono::microseconds decode_wait{50};           // base budget of an inference decode step
  std::chrono::microseconds prefill_wait{300};         // ... of an inference prefill
  std::chrono::microseconds fine_tuning_wait{500};     // ... of a fine-tuning step
  std::chrono::nanoseconds per_token_wait{1000};       // budget added per token
  std::chrono::milliseconds lockstep_timeout{1000};    // lockstep: drop clients missing this long
  std::chrono::microseconds companion_window{20000};   // opportunistic: companions must have been active this recently
  std::chrono::microseconds decode_align_wait{20000};  // opportunistic: [Decode alignment]; 0: none
  int decode_first_streak = 4;                         // [Inference first]; 0: strictly oldest first
  std::chrono::milliseconds judge_window{250};         // opportunistic: [Paying waits]; 0: decode always waits
  int judge_explore_every = 10;                        // ... one window in this many tries the other way

  void validate() const;  // throws naming the field
  std::chrono::nanoseconds budget(LatencyClass latency, int64_t tokens) const;
};

// [Paying waits]: whether decode requests wait for companions, judged by the decode requests
// served per second each way. Plain data with an explicit clock, as the Batcher.
class WaitJudge {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  explicit WaitJudge(const BatchingOptions& options)
      : window_(options.judge_window), explore_every_(std::max(2, options.judge_explore_every)) {}

  bool waits() const { return window_.count() == 0 || waits_now_; }
  // The way that served more decode requests a second, once both were measured.
  std::optional<bool> better() const {
    if (!measured_[0] || !measured_[1]) return std::nullopt;
    return rate_[1] >= rate_[0];
  }
  // Decode requests served per second with waits off (false) and on (true); 0 until measured.
  double rate(bool waits) const { return rate_[waits ? 1 : 0]; }

  // At every pop(): `served` decode requests left the Batcher at `now`.
  void tick(TimePoint now, size_t served) {
    if (window_.count() == 0) return;
    if (!started_) {
      started_ = true;
      window_start_ = now;
    }
    const auto elapsed = now - window_start_;
    if (settling_) {
      if (elapsed < window_ / 2) return;  // the tenants are still falling into or out of step
      settling_ = false;
      window_start_ = now;
      served_ = 0;
      return;
    }
    served_ += served;
    if (elapsed < window_) return;
    if (served_ > 0) {
      const double per_second = static_cast<double>(served_) / std::chrono::duration<double>(elapsed).count();
      const int way = waits_now_ ? 1 : 0;
      rate_[way] = measured_[way] ? (rate_[way] + per_second) / 2 : per_second;
      measured_[way] = true;
      windows_++;
    }
    served_ = 0;
    window_start_ = now;
    bool next = waits_now_;
    if (!measured_[1]) {
      next = true;
    } else if (!measured_[0]) {
      next = false;
    } else {
      next = *better();
      // Try the other way now and then; seldom while it is far behind.
      const double behind = std::min(rate_[0], rate_[1]) / std::max(rate_[0], rate_[1]);
      const uint64_t every = behind < 0.8 ? 8 * explore_every_ : explore_every_;
      if (windows_ % every == 0) next = !next;
    }
    if (next != waits_now_) {
      waits_now_ = next;
      settling_ = true;
    }
  }

 private:
  std::chrono::milliseconds window_;
  int explore_every_;
  bool started_ = false, settling_ = false, waits_now_ = true;
  TimePoint window_start_{};
  size_t served_ = 0;
  uint64_t windows_ = 0;  // windows measured, either way
  double rate_[2] = {0, 0};
  bool measured_[2] = {false, false};
};

template <typename Payload>
class Batcher {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;

  struct Request {
    uint64_t client_id = 0;
    uint32_t layer_id = 0;
    LayerOp op = LayerOp::kForward;
    int64_t tokens = 0;
    LatencyClass latency = LatencyClass::kFineTuning;
    TimePoint arrival{};
    bool alone = false;        // run by itself, never waited for nor packed (not under lockstep)
    bool starts_step = false;  // set by push(): a decode call at its client's first queue ([Decode alignment])
    Payload payload{};
  };

  struct Batch {
    uint32_t layer_id = 0;
    LayerOp op = LayerOp::kForward;
    int64_t tokens = 0;
    std::vector<Request> requests;
  };

  explicit Batcher(BatchingOptions options) : options_(std::move(options)), judge_(options_) { options_.validate(); }

  const BatchingOptions& options() const { return options_; }
  const WaitJudge& judge() const { return judge_; }  // [Paying waits]

  // Clients known to the executor: the lockstep set, and "everyone who could still come".
  void add_client(uint64_t client_id) { clients_.insert(client_id); }
  void remove_client(uint64_t client_id) {
    clients_.erase(client_id);
    dropped_.erase(client_id);
    tracks_.erase(client_id);
  }
  size_t clients() const { return clients_.size(); }
  size_t lockstep_set_size() const { return clients_.size() - dropped_.size(); }

  void push(Request request) {
    if (dropped_.erase(request.client_id)) clients_.insert(request.client_id);  // back in lockstep
    total_requests_++;
    total_tokens_ += request.tokens;
    client_tokens_[request.client_id] += request.tokens;
    const Key key{request.layer_id, static_cast<int>(request.op)};
    auto& track = tracks_[request.client_id];
    if (track.last_queue) track.next_after[*track.last_queue] = key;
    track.last_queue = key;
    track.last_arrival = request.arrival;
    track.last_latency = request.latency;
    if (!track.first_queue) track.first_queue = key;
    track.visited.insert(key);
    request.starts_step = request.latency == LatencyClass::kInferenceDecode && key == *track.first_queue &&
                          options_.decode_align_wait.count() > 0 && decode_waits();
    track.alone = runs_alone(request);
    if (track.alone) {
      alone_.push_back(std::move(request));
      return;
    }
    auto& queue = queues_[key];
    queue.key = key;
    if (queue.requests.empty()) active_.push_back(&queue);
    queue.requests.push_back(std::move(request));
  }

  size_t pending() const { return total_requests_; }
  // The tokens of the requests pending ([Overload]: --max-queued-tokens).
  int64_t pending_tokens() const { return total_tokens_; }
  // The same by client, clients with none left out ([Fair shares] in overload.h).
  const std::map<uint64_t, int64_t>& pending_tokens_by_client() const { return client_tokens_; }
  // Whether push() will run `request` by itself: marked alone, and not under lockstep.
  bool runs_alone(const Request& request) const {
    return request.alone && options_.policy != BatchingPolicy::kLockstep;
  }

  // The batch to run now, if any queue is ready at `now`.
  std::optional<Batch> pop(TimePoint now) {
    auto batch = next_batch(now);
    size_t decode = 0;
    if (batch) {
      for (const auto& r : batch->requests) decode += r.latency == LatencyClass::kInferenceDecode;
    }
    if (options_.policy == BatchingPolicy::kOpportunistic) judge_.tick(now, decode);
    return batch;
  }

  // Every pending request, taken out in batches whether ready or not: for a scheduler that can
  // serve none of them ([Lost part] in parts.h).
  std::vector<Batch> drain() {
    std::vector<Batch> batches;
    for (; !alone_.empty(); alone_.pop_front()) {
      batches.push_back({alone_.front().layer_id, alone_.front().op, alone_.front().tokens, {}});
      batches.back().requests.push_back(std::move(alone_.front()));
    }
    for (Queue* queue : std::vector<Queue*>(active_)) {
      while (!queue->requests.empty()) batches.push_back(take(*queue));
    }
    total_requests_ = 0;
    total_tokens_ = 0;
    client_tokens_.clear();
    return batches;
  }

  // When pop() may next return a batch without another push: the earliest deadline of any
  // queue (TimePoint::max() when nothing waits).
  TimePoint next_deadline(TimePoint now) const {
    if (!alone_.empty()) return now;
    TimePoint next = TimePoint::max();
    for (const Queue* queue : active_) next = std::min(next, deadline(*queue, now));
    return next;
  }

 private:
  // pop()'s choice.
  std::optional<Batch> next_batch(TimePoint now) {
    // The oldest ready work, and the oldest ready work that holds a decode request.
    Queue* oldest = nullptr;
    Queue* oldest_decode = nullptr;
    for (Queue* queue : active_) {
      if (!ready(*queue, now)) continue;
      if (oldest == nullptr || queue->requests.front().arrival < oldest->requests.front().arrival) oldest = queue;
      if (holds_decode(*queue) &&
          (oldest_decode == nullptr || queue->requests.front().arrival < oldest_decode->requests.front().arrival)) {
        oldest_decode = queue;
      }
    }
    const bool alone_first =
        !alone_.empty() && (oldest == nullptr || alone_.front().arrival <= oldest->requests.front().arrival);
    // [Inference first]: decode work overtakes older work, within the streak.
    if (oldest_decode != nullptr && (alone_first || oldest_decode != oldest)) {
      const bool alone_is_decode = alone_first && alone_.front().latency == LatencyClass::kInferenceDecode;
      if (!alone_is_decode && decode_streak_ < options_.decode_first_streak) {
        decode_streak_++;
        return take(*oldest_decode);
      }
    }
    decode_streak_ = 0;
    if (alone_first) {
      Batch batch{alone_.front().layer_id, alone_.front().op, alone_.front().tokens, {}};
      batch.requests.push_back(std::move(alone_.front()));
      alone_.pop_front();
      total_requests_--;
      total_tokens_ -= batch.tokens;
      count_out(batch.requests);
      return batch;
    }
    if (oldest == nullptr) return std::nullopt;
    return take(*oldest);
  }

  using Key = std::pair<uint32_t, int>;  // (layer id, op)
  struct Queue {
    Key key;
    std::deque<Request> requests;
  };
  // What the Batcher has learnt of one client's path through the queues.
  struct ClientTrack {
    std::optional<Key> last_queue;  // where its latest request went
    TimePoint last_arrival{};
    std::map<Key, Key> next_after;  // the queue that followed each queue last time
    bool alone = false;             // its latest request ran alone: no companion of anyone's
    LatencyClass last_latency = LatencyClass::kFineTuning;
    std::optional<Key> first_queue;  // [Decode alignment]: where its steps start
    std::set<Key> visited;           // every queue it came to
    std::optional<Key> predicted_next() const {
      if (!last_queue) return std::nullopt;
      auto it = next_after.find(*last_queue);
      return it == next_after.end() ? std::nullopt : std::optional<Key>(it->second);
    }
  };

  bool decode_waits() const { return options_.policy != BatchingPolicy::kOpportunistic || judge_.waits(); }

  static bool holds_decode(const Queue& queue) {
    return std::any_of(queue.requests.begin(), queue.requests.end(),
                       [](const Request& r) { return r.latency == LatencyClass::kInferenceDecode; });
  }

  int64_t queued_tokens(const Queue& queue) const {
    int64_t tokens = 0;
    for (const auto& r : queue.requests) tokens += r.tokens;
    return tokens;
  }

  static std::set<uint64_t> present(const Queue& queue) {
    std::set<uint64_t> ids;
    for (const auto& r : queue.requests) ids.insert(r.client_id);
    return ids;
  }

  static bool holds_client(const Queue& queue, uint64_t client_id) {
    return std::any_of(queue.requests.begin(), queue.requests.end(),
                       [client_id](const Request& r) { return r.client_id == client_id; });
  }

  bool every_client_present(const Queue& queue, const std::set<uint64_t>& who) const {
    const auto ids = present(queue);
    return std::all_of(who.begin(), who.end(), [&](uint64_t id) { return ids.count(id) > 0; });
  }

  // Opportunistic: is another active client predicted to come to this queue next, or, at a step's
  // rendezvous, any active decode client that comes here ([Decode alignment])?
  bool companion_expected(const Queue& queue, TimePoint now) const {
    const bool rendezvous =
        std::any_of(queue.requests.begin(), queue.requests.end(), [](const Request& r) { return r.starts_step; });
    for (const auto& [id, track] : tracks_) {
      if (track.alone || now - track.last_arrival > options_.companion_window || !clients_.count(id) ||
          holds_client(queue, id)) {
        continue;
      }
      if (track.predicted_next() == queue.key) return true;
      if (rendezvous && track.last_latency == LatencyClass::kInferenceDecode && track.visited.count(queue.key)) {
        return true;
      }
    }
    return false;
  }

  std::set<uint64_t> lockstep_set() const {
    std::set<uint64_t> set;
    std::set_difference(clients_.begin(), clients_.end(), dropped_.begin(), dropped_.end(),
                        std::inserter(set, set.end()));
    return set;
  }

  // [Lockstep catch-up]: the queue of the clients behind, when every client of `set` has a request
  // queued and none holds them all; nullptr otherwise.
  const Queue* behind(const std::set<uint64_t>& set) const {
    std::set<uint64_t> queued;
    const Queue* fewest = nullptr;
    for (const Queue* queue : active_) {
      const auto ids = present(*queue);
      const size_t members = std::count_if(ids.begin(), ids.end(), [&](uint64_t id) { return set.count(id) > 0; });
      if (members == 0) continue;
      if (members == set.size()) return nullptr;  // it runs as it is
      queued.insert(ids.begin(), ids.end());
      if (fewest == nullptr || queue->requests.size() < fewest->requests.size() ||
          (queue->requests.size() == fewest->requests.size() &&
           queue->requests.back().arrival > fewest->requests.back().arrival)) {
        fewest = queue;
      }
    }
    const bool all_queued = std::all_of(set.begin(), set.end(), [&](uint64_t id) { return queued.count(id) > 0; });
    return all_queued ? fewest : nullptr;
  }

  // The time at which the queue becomes ready by waiting alone.
  TimePoint deadline(const Queue& queue, TimePoint now) const {
    switch (options_.policy) {
      case BatchingPolicy::kNone: return queue.requests.front().arrival;
      case BatchingPolicy::kLockstep: {
        const auto set = lockstep_set();
        return every_client_present(queue, set) || behind(set) == &queue
                   ? now
                   : queue.requests.front().arrival + options_.lockstep_timeout;
      }
      case BatchingPolicy::kOpportunistic: {
        TimePoint earliest = TimePoint::max();
        for (const auto& r : queue.requests) {
          if (r.latency == LatencyClass::kInferenceDecode && !decode_waits()) return r.arrival;  // [Paying waits]
          const auto budget = r.starts_step ? options_.decode_align_wait : options_.budget(r.latency, r.tokens);
          earliest = std::min(earliest, r.arrival + std::chrono::duration_cast<Clock::duration>(budget));
        }
        return earliest;
      }
    }
    return now;
  }

  bool ready(Queue& queue, TimePoint now) {
    switch (options_.policy) {
      case BatchingPolicy::kNone: return true;
      case BatchingPolicy::kLockstep: {
        const auto set = lockstep_set();
        if (every_client_present(queue, set) || behind(set) == &queue) return true;
        if (now - queue.requests.front().arrival < options_.lockstep_timeout) return false;
        // Stalled or gone: drop the missing clients from the set so the others go on.
        const auto ids = present(queue);
        for (uint64_t id : set) {
          if (!ids.count(id)) dropped_.insert(id);
        }
        return true;
      }
      case BatchingPolicy::kOpportunistic:
        return deadline(queue, now) <= now || queued_tokens(queue) >= options_.max_batch_tokens ||
               !companion_expected(queue, now);
    }
    return true;
  }

  Batch take(Queue& queue) {
    auto& requests = queue.requests;
    Batch batch;
    batch.layer_id = requests.front().layer_id;
    batch.op = requests.front().op;
    // [Paying waits]: with decode waits off, decode runs as under `none`, a request a batch (on a GPU,
    // a lone request is computed in place on its client's stream beside others' GEMMs, where packed
    // rows would be copied in and out on one stream).
    const bool alone = options_.policy == BatchingPolicy::kNone ||
                       (requests.front().latency == LatencyClass::kInferenceDecode && !decode_waits());
    const size_t limit = alone ? 1 : requests.size();
    while (!requests.empty() && batch.requests.size() < limit &&
           (batch.requests.empty() || batch.tokens + requests.front().tokens <= options_.max_batch_tokens)) {
      batch.tokens += requests.front().tokens;
      batch.requests.push_back(std::move(requests.front()));
      requests.pop_front();
    }
    total_requests_ -= batch.requests.size();
    total_tokens_ -= batch.tokens;
    count_out(batch.requests);
    if (requests.empty()) std::erase(active_, &queue);
    return batch;
  }

  // Takes `requests`, which leave the Batcher, out of their clients' pending tokens.
  void count_out(const std::vector<Request>& requests) {
    for (const auto& r : requests) {
      const auto it = client_tokens_.find(r.client_id);
      if (it != client_tokens_.end() && (it->second -= r.tokens) <= 0) client_tokens_.erase(it);
    }
  }

  BatchingOptions options_;
  std::map<Key, Queue> queues_;  // every queue ever used (node addresses are stable)
  std::vector<Queue*> active_;   // the queues holding requests: what pop() looks at
  std::deque<Request> alone_;    // requests that run by themselves, oldest first
  std::set<uint64_t> clients_;
  std::set<uint64_t> dropped_;              // lockstep: clients not waited for until their next request
  std::map<uint64_t, ClientTrack> tracks_;  // opportunistic: each client's learnt path
  size_t total_requests_ = 0;
  int64_t total_tokens_ = 0;
  std::map<uint64_t, int64_t> client_tokens_;  // total_tokens_ by client ([Fair shares])
  int decode_streak_ = 0;                      // [Inference first]: batches in a row that overtook older work
  WaitJudge judge_;                            // [Paying waits]
};

}  // namespace symbiosis
