#pragma once
// A fine-tuning loop for tenants: AdamW on a model's adapter parameters over a TokenDataset
// (dataset.h), with gradient accumulation, linear warm-up then cosine learning rate, gradient-norm
// clipping, evaluation loss on held-out data, a progress display, and checkpoints that resume
// exactly.
//
// Works with any PEFT method: the trainer sees only the trainable tensors (add_lora's result,
// add_ia3's, adapter_parameters(model), ...) and, for saving the adapter in its method's PEFT
// format, an AdapterSaver (e.g. [&](auto& dir) { save_lora(*lm.module, config, dir); }).
//
// [Loss over an optimizer step] A step's loss is the mean next-token cross-entropy over every
// trained position of all its micro-batches (each micro-batch's summed loss is divided by the
// step's total target count before backward). So grad_accum micro-batches of n rows compute what
// one batch of grad_accum*n rows would (transformers' num_items_in_batch semantics), however the
// targets are spread over the micro-batches.
//
// [Exact resume] save_checkpoint(dir) writes, at a step boundary:
//   adapter/             the adapter in its PEFT format (when an AdapterSaver was given)
//   trainable.pt         the trainable tensors themselves, in order (exact, whatever the method)
//   optimizer.pt         AdamW's state (step counts and moments)
//   rng_state.pt         the default CPU generator's state (LoRA dropout draws from it)
//   trainer_state.json   step, epoch, next micro-batch of the epoch, the settings that fix the data
//                        order and the schedule, and the history so far
// The data order of an epoch is a function of (seed, epoch) alone, so the position is two numbers.
// load_checkpoint() on a new Trainer (new model with the same adapter structure attached) restores
// all of it; the steps that follow are bit-for-bit those of an uninterrupted run. It refuses a
// checkpoint whose settings or dataset size differ, naming the field, except the run's length
// (max_steps, epochs): a run, finished or not, may be extended, and the steps after the resume then
// follow the longer schedule. On a GPU the CUDA generator's state is saved too.
//
// [Training on a GPU] With the model on a CUDA device the trainer keeps a step's work on the GPU:
// the loss and the gradient norm stay there until the step ends (one synchronization a step), the
// gradients are clipped with foreach kernels, and the optimizer is FusedAdamW (one fused kernel,
// the learning rate read from a GPU tensor). With `capture` (the default), the step is replayed
// from CUDA graphs ([Captured steps] in step_graph.h), which needs one shape for every step: each
// step runs grad_accum micro-batches of micro_batch_size rows of longest_row() tokens (dataset.h),
// the missing rows and micro-batches padding that is never trained on. The losses are those of the
// eager step within rounding (padding to a longer row changes no real token's result).
//
// Thread safety: none; one thread drives a Trainer.
#include <ATen/ATen.h>

#include <cstdint>
#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/training/dataset.h"

namespace symbiosis {

struct TrainerOptions {
  MicroBatchOptions batching;  // micro-batch size, padding or packing (dataset.h)
  int64_t grad_accum = 1;      // micro-batches per optimizer step
  bool shuffle = true;         // a new order each epoch, drawn from (seed, epoch)
  uint64_t seed = 0;
  int64_t epochs = 1;     // passes over the data, when max_steps is 0
  int64_t max_steps = 0;  // > 0: stop after this many steps (passes repeat as needed)

  double learning_rate = 1e-4;     // the peak, reached at the end of warm-up
  int64_t warmup_steps = 0;        // linear from 0 to learning_rate over these steps
  double min_learning_rate = 0.0;  // the cosine decays to this at the last step
  double weight_decay = 0.0;       // AdamW (decoupled); 0 as in transformers (LibTorch's default is 0.01)
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;
  double max_grad_norm = 1.0;  // clip the global gradient norm to this; 0: no clipping

  int64_t eval_every = 0;          // evaluate every N steps (and at the end); 0: only at the end
  int64_t save_every = 0;          // train(): checkpoint every N steps (and at the end) into save_dir
  std::filesystem::path save_dir;  // empty: train() writes no checkpoints
  // train(): keep only the newest N checkpoints in save_dir (transformers' save_total_limit); 0: all.
  // Beside them, `latest` links to the newest.
  int64_t save_total_limit = 0;
  // train(): once it turns true (a signal handler's flag), the step in progress is the last, and
  // its checkpoint is saved as at the end.
  const std::atomic<bool>* stop = nullptr;
  bool progress = true;  // train(): the progress display on stderr
  bool capture = true;   // on a CUDA device: captured steps ([Training on a GPU])
  // The base model's hash (Checkpoint::model_hash), recorded in checkpoints: resuming on another
  // base model is refused naming both. Empty: not recorded or checked.
  std::string model_hash;

  void validate() const;  // throws naming the bad field
};

// The learning rate of optimizer step `step` (0-based) of `total`: step/warmup * peak during
// warm-up, then min + (peak-min) * (1 + cos(pi * progress)) / 2 with progress going from 0 at the
// end of warm-up to 1 at step `total` (transformers' get_cosine_schedule_with_warmup when min = 0).
double warmup_cosine_learning_rate(int64_t step, int64_t total, int64_t warmup, double peak, double min = 0.0);

// The schedule's length: max_steps, or the steps of `epochs` passes over the data.
int64_t planned_steps(const TokenDataset& train, const TrainerOptions& options);

struct StepStats {
  int64_t step = 0;                 // 1-based: the number of optimizer steps done after this one
  int64_t epoch = 0;                // 0-based epoch the step's data came from
  double loss = 0;                  // [Loss over an optimizer step]
  double learning_rate = 0;         // used by this step
  double grad_norm = 0;             // before clipping
  int64_t tokens = 0;               // real (non-padding) input tokens
  int64_t targets = 0;              // trained positions
  double seconds = 0;               // wall time of the step
  std::optional<double> eval_loss;  // when train() evaluated after this step
};

// Writes the adapter into a directory (created before the call) in its method's format.
using AdapterSaver = std::function<void(const std::filesystem::path& dir)>;

// What a PEFT method adds to a training step (AdaLoRA: its orthogonal regularization and its rank
// allocator, as symbiosis-finetune attaches them).
struct TrainerHooks {
  // A differentiable scalar added once to each step's loss (reported in StepStats::loss too).
  std::function<at::Tensor()> extra_loss;
  // Called after the optimizer's update with the 1-based step count, while the step's gradients
  // are still in the parameters' grad(). Runs eagerly, outside any captured graph.
  std::function<void(int64_t step)> after_update;
};

class Trainer {
 public:
  // model: a CausalLM (split or monolithic) with its adapter attached; parameters: the tensors to
  // train (requires_grad), shared with the model. Checks the data's token ids against the model's
  // vocabulary (Llama and GPT-2) and that packing has a model that takes position ids.
  Trainer(CausalLM model, std::vector<at::Tensor> parameters, TokenDataset train, TrainerOptions options,
          AdapterSaver save_adapter = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void set_eval_data(TokenDataset eval);
  void set_hooks(TrainerHooks hooks);  // before the first step

  // One optimizer step over the next grad_accum micro-batches (fewer at the end of an epoch).
  // Gradients stay in the parameters' grad() until the next step.
  StepStats step();
  // Runs at most `steps` more steps (all the remaining ones when negative), with evaluation,
  // checkpoints and the progress display as the options say. Returns the stats of the steps run.
  std::vector<StepStats> train(int64_t steps = -1);
  // Mean next-token loss over every trained position of the data, in file order, without
  // gradients or dropout. The eval data set by set_eval_data() when none is given.
  double evaluate();
  double evaluate(const TokenDataset& data);

  void save_checkpoint(const std::filesystem::path& dir) const;  // see [Exact resume]
  void load_checkpoint(const std::filesystem::path& dir);

  int64_t steps_done() const;
  int64_t total_steps() const;
  bool done() const { return steps_done() >= total_steps(); }
  const std::vector<StepStats>& history() const;  // every step so far, including before a resume
  const std::vector<at::Tensor>& parameters() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The "checkpoint-<step>" directories under save_dir that hold a whole checkpoint, oldest first.
std::vector<std::filesystem::path> checkpoints_in(const std::filesystem::path& save_dir);
// The PEFT adapter folder `path` names: the folder itself when it holds adapter_config.json, a
// trainer checkpoint's adapter/, or a run's (a --save-dir's) newest checkpoint's adapter/; throws
// naming the path and the three forms when it is none of them.
std::filesystem::path adapter_in(const std::filesystem::path& path);
// The newest "checkpoint-<step>" directory under save_dir, or save_dir itself when it holds a
// trainer_state.json; throws when there is none.
std::filesystem::path latest_checkpoint(const std::filesystem::path& save_dir);

}  // namespace symbiosis
