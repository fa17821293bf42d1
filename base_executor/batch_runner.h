#pragma once
// The executor's batch data path ([Batch data path]): gathers a batch's inputs from the channels
// of its calls, runs the layer's GEMM, scatters the results to where each client reads them, and
// answers every call (an error for each, if the batch failed). Runs on the scheduler's thread.
#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "base_executor/base_model.h"
#include "base_executor/batching.h"
#include "base_executor/executor.h"
#include "base_executor/gpu_share.h"
#include "base_executor/statistics.h"
#include "transport/call_ring.h"
#include "transport/channel.h"

namespace symbiosis {

// One call the executor took, whichever transport brought it: its checked header and its client's
// channel, which reads its input and takes its result.
struct Call {
  shm::CallHeader header;
  std::shared_ptr<Channel> channel;
  at::Tensor destination;  // where its result goes, if the channel gave a place (set while running)
};
using CallBatcher = Batcher<Call>;

// A call's proto::Op as the base model computes it.
LayerOp to_layer_op(int32_t op);

class ReplayedBatches;  // [Replayed batches], batch_runner.cpp
class Parts;            // parts.h

class BatchRunner : public CallEnqueuer {
 public:
  // on_input: [Input observer] (base_executor/executor.h), called with every call's input; may be empty.
  // parts: a sharded executor's ([Parts] in parts.h), with whom every batch is computed; null: alone.
  BatchRunner(const BaseModel& model, Statistics& statistics, InputObserver on_input = {}, Parts* parts = nullptr);
  ~BatchRunner();
  // With parts, the other parts must be computing this batch with it ([Rounds] in parts.h).
  // share: the batch's share of the GPU ([GPU share] in gpu_share.h), under which its caller has
  // set the GEMMs' multiprocessors. [Fine-tuning in pieces]: a call computed in place, of more
  // rows than share.piece_rows (> 0), runs as GEMMs of at most that many rows, one after another:
  // a kernel of the GEMM library on Hopper holds a block on each multiprocessor it runs on until
  // its product is done, so a decode call that comes meanwhile waits for one piece, not the whole
  // product. Results agree with the whole GEMM's within the dtype's rounding (another row count
  // may take another kernel).
  void run(CallBatcher::Batch& batch, const GpuShare& share = {});
  // Answers each of the batch's calls with `status`.
  void refuse(CallBatcher::Batch& batch, const Status& status);
  // [CPU threads] (cpu_threads.h): from now on the calling thread's OpenMP team is sized for each
  // batch, up to `cores`. Call on the thread that runs batches.
  void size_cpu_teams(int cores) { cpu_cores_ = cores; }
  uint64_t batches() const { return batches_; }  // run so far
  // [Steps launched ahead] (transport/cuda_ipc/cuda_ipc_channel.cpp): a call's GEMM in place in its
  // channel's memory, on the current stream; a first GEMM on a stream before any capture on it.
  void enqueue(Channel& channel, const shm::CallHeader& h) override;
  // [Runs launched together]: the scratch holds both the packed inputs and the packed results.
  void enqueue_packed(const std::vector<std::pair<Channel*, shm::CallHeader>>& calls,
                      const at::Tensor& scratch) override;
  at::Tensor packing_scratch(int64_t rows) override;
  void warm_up_stream() override;

 private:
  // Each call's result rows: views into the batch's result, or its destination.
  std::vector<at::Tensor> compute(CallBatcher::Batch& batch);
  // Each call's input (undefined where its channel receives it straight into the batch: NCCL), its
  // destination set; the [Input observer] sees them.
  std::vector<at::Tensor> read_inputs(CallBatcher::Batch& batch, uint64_t number);
  // The batch's input rows, packed; first_row[i]: where call i's rows start.
  at::Tensor pack(CallBatcher::Batch& batch, uint64_t number, const std::vector<at::Tensor>& inputs,
                  std::vector<int64_t>& first_row);
  void deliver(CallBatcher::Batch& batch, std::vector<at::Tensor>& results);
  // A call's GEMM from x into out, in place, in pieces of share_.piece_rows ([Fine-tuning in pieces]).
  void compute_in_pieces(uint32_t layer_id, LayerOp op, const at::Tensor& x, at::Tensor& out) const;

  const BaseModel& model_;
  Statistics& statistics_;
  const InputObserver on_input_;
  uint64_t batches_ = 0;                      // run so far: the [Input observer]'s batch numbers
  std::vector<Statistics::BatchCall> calls_;  // the batch's calls, for the statistics (kept: no allocation a batch)
  std::unique_ptr<ReplayedBatches> replays_;  // on a GPU
  Parts* const parts_;
  int cpu_cores_ = 0;  // [CPU threads]: 0: the team is left as it is
  GpuShare share_;     // the batch's, while it runs
};

}  // namespace symbiosis
