#pragma once
// [GPU share]: how a GPU executor runs a batch beside decoding tenants ([Fine-tuning's SMs] in
// kernels/direct_gemm.h, [Fine-tuning in pieces] in batch_runner.h), decided from the batch's class
// and the time since a decode call came or a decode step was ready last: the scheduler's clock, a
// fake one in tests (tests/base_executor/batching_test.cpp); and which calls run by themselves.
#include <chrono>
#include <cstdint>

namespace symbiosis {

// Tenants decode "lately" within this of their last decode call or step.
constexpr std::chrono::milliseconds kDecodingLately{50};

struct GpuShare {
  int sm_percent = 100;       // the share of the GPU's multiprocessors its GEMMs are sized for
  int piece_rows = 0;         // a call's GEMMs of at most this many rows; 0: whole
  bool low_priority = false;  // run in place, on its client's low-priority stream
  bool yields() const { return sm_percent < 100 || piece_rows > 0; }
  // Tells shares apart for the graphs recorded of a call's GEMMs, which keep the share they were
  // recorded under (Channel::compute_replayed's variant).
  int variant() const { return sm_percent + 1000 * piece_rows; }
};

// A batch of fine-tuning calls alone, while tenants decode lately, takes finetune_sm_percent of the
// multiprocessors and runs in pieces of finetune_piece_rows (0: whole). It runs at low priority
// unless in pieces: a piece runs at the decode calls' priority, so that fine-tuning is not left
// only the GPU's gaps. Any other batch runs whole, on all the multiprocessors.
inline GpuShare gpu_share(bool fine_tuning, std::chrono::steady_clock::duration since_decode, int finetune_sm_percent,
                          int finetune_piece_rows) {
  GpuShare share;
  if (fine_tuning && since_decode < kDecodingLately) {
    share.sm_percent = finetune_sm_percent;
    share.piece_rows = finetune_piece_rows;
  }
  share.low_priority = fine_tuning && share.piece_rows == 0;
  return share;
}

// Where a call's input rows are when the executor takes it up.
enum class CallRows {
  kHost,      // in host memory (shm, tcp): copied to the GPU with the batch
  kInPlace,   // in the same-GPU client's memory (CUDA IPC): computed in place
  kReceived,  // received into the executor's GPU memory (NCCL)
};

// [Calls by themselves]: on a GPU, a call of at least concurrent_tokens rows already on the GPU runs
// by itself, at once, never waited for nor packed (CallBatcher's `alone`). At that size its GEMM
// reads the weights for enough rows, and packing only adds the wait for companions and the copies
// in and out: 1 024-row calls packed took 1.09 to 1.84 times as long as one after another ("GEMM
// shapes" in docs/benchmarks-history.md), and fine-tuning tenants over NCCL, packed 1.24 calls a
// batch, made 0.954x the tokens/s they made under `none` (V62). A same-GPU call then runs in place
// on its client's stream, beside the others' GEMMs, which needs more than one stream; a received
// one on the first stream, as under `none`. Calls from host memory batch as before.
inline bool runs_by_itself(CallRows rows, int64_t tokens, int64_t concurrent_tokens, int streams) {
  if (concurrent_tokens <= 0 || tokens < concurrent_tokens) return false;
  return rows == CallRows::kReceived || (rows == CallRows::kInPlace && streams > 1);
}

}  // namespace symbiosis
