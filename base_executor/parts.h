#pragma once
// [Parts] A sharded executor: one base model served by several executor processes, its parts, one
// per GPU (or per CPU process), on one host or several (the paper's sharded-local and
// sharded-remote placements; docs/sharding.md has the design and its measurements). Each part is
// a whole executor to its clients (its own endpoint, front door, scheduler and batching) that holds
// a share of every base layer: the rows [out * r / n, out * (r + 1) / n) of each layer's output
// features, and its groups' stacked from its members' shares ([Layer groups] in base_model.h).
// The parts join through LibTorch's distributed library (c10d): a TCP store for the rendezvous, a
// Gloo process group between their CPUs, and on GPUs a NCCL process group for the activations.
//
// [Rounds] The parts run in rounds. In each, every part offers the batch its Batcher gave (or
// none), and one all-gather over Gloo tells every part what all of them offer. Then, part by part
// in rank order, each batch is computed by all: its owner broadcasts the batch's packed input, each
// part multiplies it by its share (forward: its columns of the output, with the full reduction, so
// a row equals the one-GPU product; backward-input: its rows' part of the sum), and the owner
// gathers the columns (forward) or sums the parts (backward-input) into the batch's result. Tensor
// parallelism, not FSDP's gathered weights: a per-layer call moves its activations (kilobytes to a
// few megabytes) instead of the layer's weight (tens to hundreds of megabytes); measured in
// docs/sharding.md. Clients of different parts never wait for each other's batches to fill, and the
// executor stays stateless: a round holds nothing after it ends.
//
// [Lost part] A part that dies closes its connections, and the next collective of every other part
// fails at once (a part that hangs: within --part-timeout). Each remaining part then refuses every
// call it holds, and every later one, with UNAVAILABLE naming the part, and its executor stops,
// telling its clients why ([Shutdown notice] in front_door.cpp). A part that is stopped says so in
// its last round, and the others stop with it.
// Thread safety: one thread (the scheduler's) uses a Parts after join().
#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base_executor/base_model.h"
#include "common/status.h"

namespace c10d {
class Work;
}

namespace symbiosis {

struct PartGroups;  // part_groups.h: the c10d process groups

struct PartOptions {
  int rank = 0;
  int world_size = 1;
  // "HOST:PORT" of the rendezvous (rank 0 listens there); empty: not sharded.
  std::string rendezvous;
  // The network interface Gloo's connections use (e.g. eth0); empty: the address the host name
  // resolves to, or loopback when the rendezvous is on loopback.
  std::string interface;
  // How long a part waits for the others in a collective before it counts them lost.
  std::chrono::milliseconds timeout{30000};

  bool sharded() const { return !rendezvous.empty(); }
  // Throws naming the field when an option is out of range.
  void validate() const;
};

// "127.0.0.1:PORT" with a loopback port free now: a rendezvous for parts started together on this
// host (the launcher's, the tests').
std::string free_loopback_rendezvous();

// What one part offers in a round.
struct RoundOffer {
  enum Kind : int64_t { kNone = 0, kBatch = 1, kLeaving = 2 };
  Kind kind = kNone;
  uint32_t layer_id = 0;
  LayerOp op = LayerOp::kForward;
  int64_t tokens = 0;
  int64_t features = 0;  // of the input
};

class Parts {
 public:
  // Joins the other parts (blocks until all have joined, or throws after the timeout).
  static std::unique_ptr<Parts> join(const PartOptions& options, at::Device device);
  ~Parts();

  int rank() const { return options_.rank; }
  int size() const { return options_.world_size; }
  // "part R of N"
  std::string name() const;

  // [Rounds]: every part's offer, by rank. Throws when a part is lost.
  std::vector<RoundOffer> exchange(const RoundOffer& mine);
  // Computes part `owner`'s batch with the others: at the owner, `input()` gives the batch's packed
  // input ([tokens, features] on the model's device) and the batch's result is returned; elsewhere
  // `input` is not called and the result is undefined. Should `input()` throw, the owner still does
  // its part of the collectives (with zeros) and then rethrows. Throws when a part is lost.
  at::Tensor compute(const BaseModel& model, int owner, const RoundOffer& batch,
                     const std::function<at::Tensor()>& input);
  // Tells the others, in a last round, that this part stops (they stop too). Never throws.
  void leave();
  // [Lost part]: UNAVAILABLE naming what failed, once a collective has; the parts serve no more.
  const std::optional<Status>& lost() const { return lost_; }

 private:
  Parts(const PartOptions& options, at::Device device);
  // Waits for one collective; one that fails (a part gone, or late past the timeout) makes the
  // parts lost() and throws naming what it waited for.
  void finish(const c10::intrusive_ptr<c10d::Work>& work, const char* what);

  PartOptions options_;
  at::Device device_;
  std::unique_ptr<PartGroups> groups_;  // part_groups.h
  std::optional<Status> lost_;
};

}  // namespace symbiosis
