#pragma once
// [GPU share]: how a GPU executor runs a batch beside decoding tenants ([Fine-tuning's SMs] in
// kernels/direct_gemm.h, [Fine-tuning in pieces] in batch_runner.h), decided from the batch's class
// and the time since a decode call came or a decode step was ready last: the scheduler's clock, a
// fake one in tests (tests/base_executor/batching_test.cpp).
#include <chrono>

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

}  // namespace symbiosis
