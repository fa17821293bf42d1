#include "client_runtime/training/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <regex>

#include "client_runtime/client.h"
#include "client_runtime/models/gpt2.h"
#include "client_runtime/models/llama.h"
#include "client_runtime/training/fused_adamw.h"
#include "client_runtime/training/loss.h"
#include "client_runtime/training/step_graph.h"

namespace symbiosis {

namespace fs = std::filesystem;

void TrainerOptions::validate() const {
  batching.validate();
  TORCH_CHECK(grad_accum >= 1, "grad_accum is ", grad_accum, ", expected at least 1");
  TORCH_CHECK(epochs >= 1, "epochs is ", epochs, ", expected at least 1");
  TORCH_CHECK(max_steps >= 0, "max_steps is ", max_steps, ", expected 0 (use epochs) or a positive count");
  TORCH_CHECK(learning_rate > 0 && std::isfinite(learning_rate), "learning_rate is ", learning_rate, ", expected > 0");
  TORCH_CHECK(min_learning_rate >= 0 && min_learning_rate <= learning_rate, "min_learning_rate is ", min_learning_rate,
              ", expected between 0 and learning_rate (", learning_rate, ")");
  TORCH_CHECK(warmup_steps >= 0, "warmup_steps is ", warmup_steps, ", expected >= 0");
  TORCH_CHECK(weight_decay >= 0, "weight_decay is ", weight_decay, ", expected >= 0");
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "betas are (", beta1, ", ", beta2,
              "), expected each in [0, 1)");
  TORCH_CHECK(epsilon > 0, "epsilon is ", epsilon, ", expected > 0");
  TORCH_CHECK(max_grad_norm >= 0, "max_grad_norm is ", max_grad_norm, ", expected >= 0 (0: no clipping)");
  TORCH_CHECK(eval_every >= 0, "eval_every is ", eval_every, ", expected >= 0");
  TORCH_CHECK(save_every >= 0, "save_every is ", save_every, ", expected >= 0");
  TORCH_CHECK(save_every == 0 || !save_dir.empty(), "save_every is ", save_every, " but save_dir is empty");
  TORCH_CHECK(save_total_limit >= 0, "save_total_limit is ", save_total_limit,
              ", expected >= 0 (0: keep every checkpoint)");
}

double warmup_cosine_learning_rate(int64_t step, int64_t total, int64_t warmup, double peak, double min) {
  if (step < warmup) return peak * static_cast<double>(step) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  return min + (peak - min) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

int64_t planned_steps(const TokenDataset& train, const TrainerOptions& options) {
  if (options.max_steps > 0) return options.max_steps;
  int64_t total = 0;
  for (int64_t e = 0; e < options.epochs; ++e) {
    const auto micro_batches = static_cast<int64_t>(
        plan_micro_batches(train, epoch_order(train.size(), options.seed, e, options.shuffle), options.batching)
            .size());
    total += (micro_batches + options.grad_accum - 1) / options.grad_accum;
  }
  return total;
}

namespace {

// The forward pass a micro-batch needs. Position ids (packing) reach the Llama and GPT-2 modules
// directly, since CausalLM::forward takes none.
at::Tensor model_forward(const CausalLM& lm, const MicroBatch& mb, bool with_positions) {
  if (!with_positions) return lm.forward(mb.input_ids, mb.attention_mask);
  if (auto* llama = dynamic_cast<LlamaForCausalLMImpl*>(lm.module.get())) {
    return llama->forward(mb.input_ids, mb.attention_mask, mb.position_ids);
  }
  if (auto* gpt2 = dynamic_cast<GPT2LMHeadModelImpl*>(lm.module.get())) {
    return gpt2->forward(mb.input_ids, mb.attention_mask, mb.position_ids);
  }
  TORCH_CHECK(false, "packing needs position ids, which only LlamaForCausalLM and GPT2LMHeadModel take here");
}

std::optional<int64_t> vocab_size(const CausalLM& lm) {
  if (auto* llama = dynamic_cast<LlamaForCausalLMImpl*>(lm.module.get())) return llama->config().vocab_size;
  if (auto* gpt2 = dynamic_cast<GPT2LMHeadModelImpl*>(lm.module.get())) return gpt2->config().vocab_size;
  return std::nullopt;
}

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", (long long)(s / 3600), (long long)(s / 60 % 60),
                  (long long)(s % 60));
  } else {
    std::snprintf(text, sizeof text, "%02lld:%02lld", (long long)(s / 60), (long long)(s % 60));
  }
  return text;
}

// Progress on stderr: one redrawn line with a bar on a terminal, a plain line a step otherwise.
class ProgressDisplay {
 public:
  ProgressDisplay(int64_t first, int64_t total) : first_(first), total_(total), tty_(::isatty(::fileno(stderr)) == 1) {}
  ~ProgressDisplay() {
    if (tty_ && drawn_) std::fputc('\n', stderr);
  }
  void update(const StepStats& s, double elapsed, int64_t tokens) {
    const double rate = elapsed > 0 ? tokens / elapsed : 0;
    const int64_t done = s.step - first_;
    const double eta = done > 0 ? elapsed / done * (total_ - s.step) : NAN;
    char stats[200];
    std::snprintf(stats, sizeof stats, "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %s", (long long)s.step,
                  (long long)total_, s.loss, s.learning_rate, rate, clock_text(eta).c_str());
    std::string line = stats;
    if (s.eval_loss) line += "  eval " + std::to_string(*s.eval_loss).substr(0, 6);
    if (tty_) {
      constexpr int kWidth = 24;
      const int filled = total_ > 0 ? static_cast<int>(kWidth * s.step / total_) : kWidth;
      std::string bar = "[" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "] ";
      std::fprintf(stderr, "\r\033[K%s%s", bar.c_str(), line.c_str());
      if (s.eval_loss) std::fputc('\n', stderr);  // keep evaluations in the scroll-back
      drawn_ = !s.eval_loss;
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }

 private:
  int64_t first_, total_;
  bool tty_;
  bool drawn_ = false;
};

nlohmann::json options_json(const TrainerOptions& o, const TokenDataset& train) {
  nlohmann::json settings = {{"seed", o.seed},
                             {"shuffle", o.shuffle},
                             {"micro_batch_size", o.batching.micro_batch_size},
                             {"batching", o.batching.mode == BatchingMode::kPacking ? "packing" : "padding"},
                             {"pack_length", o.batching.pack_length},
                             {"max_length", o.batching.max_length},
                             {"grad_accum", o.grad_accum},
                             {"epochs", o.epochs},
                             {"max_steps", o.max_steps},
                             {"learning_rate", o.learning_rate},
                             {"warmup_steps", o.warmup_steps},
                             {"min_learning_rate", o.min_learning_rate},
                             {"train_examples", train.size()},
                             {"train_tokens", train.num_tokens()}};
  if (!o.model_hash.empty()) settings["model_hash"] = o.model_hash;
  return settings;
}

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file);
  out << text;
  TORCH_CHECK(out.good(), file.string(), ": write failed");
}

}  // namespace

namespace {

// [Checkpoints]: `latest` beside the numbered checkpoints links to the newest (replaced in one
// rename), and past `limit` (> 0) the oldest go.
void keep_checkpoints(const fs::path& save_dir, int64_t limit) {
  const auto found = checkpoints_in(save_dir);
  if (found.empty()) return;
  const fs::path link = save_dir / "latest", made = save_dir / "latest.partial";
  fs::remove(made);
  fs::create_directory_symlink(found.back().filename(), made);
  fs::rename(made, link);
  for (size_t i = 0; limit > 0 && i + static_cast<size_t>(limit) < found.size(); ++i) fs::remove_all(found[i]);
}

}  // namespace

class Trainer::Impl {
 public:
  Impl(CausalLM model, std::vector<at::Tensor> parameters, TokenDataset train, TrainerOptions options,
       AdapterSaver save_adapter)
      : lm(std::move(model)),
        params(std::move(parameters)),
        data(std::move(train)),
        options(std::move(options)),
        save_adapter(std::move(save_adapter)) {
    this->options.validate();
    TORCH_CHECK(lm.module && lm.forward, "Trainer: the model is empty");
    TORCH_CHECK(!params.empty(), "Trainer: no trainable parameters (attach an adapter first)");
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(params[i].requires_grad(), "Trainer: trainable tensor ", i, " does not require grad");
    }
    check_vocab(data);
    packed = this->options.batching.mode == BatchingMode::kPacking;
    if (packed) {
      TORCH_CHECK(
          dynamic_cast<LlamaForCausalLMImpl*>(lm.module.get()) || dynamic_cast<GPT2LMHeadModelImpl*>(lm.module.get()),
          "packing needs position ids, which only LlamaForCausalLM and GPT2LMHeadModel take here");
    }
    device = params.front().device();
    const auto& o = this->options;
    if (device.is_cuda()) {
      gpu = make_device_step();
    } else {
      optimizer = make_optimizer();
    }
    total = planned_steps(data, o);
    plans = plan_epoch(0);
  }

  std::unique_ptr<torch::optim::AdamW> make_optimizer() const {
    const auto& o = options;
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(o.learning_rate)
                                                             .betas({o.beta1, o.beta2})
                                                             .eps(o.epsilon)
                                                             .weight_decay(o.weight_decay));
  }

  std::unique_ptr<FusedAdamW> make_fused_optimizer() const {
    const auto& o = options;
    auto fused = std::make_unique<FusedAdamW>(
        params, FusedAdamWOptions{o.learning_rate, o.beta1, o.beta2, o.epsilon, o.weight_decay});
    return fused;
  }

  void check_vocab(const TokenDataset& d) const {
    const auto vocab = vocab_size(lm);
    if (!vocab) return;
    for (size_t i = 0; i < d.size(); ++i) {
      for (size_t k = 0; k < d[i].input_ids.size(); ++k) {
        TORCH_CHECK(d[i].input_ids[k] < *vocab, d.where(i), ": input_ids[", k, "] = ", d[i].input_ids[k],
                    " is not below the model's vocab_size ", *vocab);
        TORCH_CHECK(d[i].labels[k] < *vocab, d.where(i), ": labels[", k, "] = ", d[i].labels[k],
                    " is not below the model's vocab_size ", *vocab);
      }
    }
  }

  std::vector<MicroBatchPlan> plan_epoch(int64_t e) const {
    return plan_micro_batches(data, epoch_order(data.size(), options.seed, e, options.shuffle), options.batching);
  }

  MicroBatch to_device(MicroBatch mb) const {
    mb.input_ids = mb.input_ids.to(device);
    mb.attention_mask = mb.attention_mask.to(device);
    mb.position_ids = mb.position_ids.to(device);
    mb.labels = mb.labels.to(device);
    return mb;
  }

  // [Lost executor]
  // A step that fails (its executor gone for good: stopped and not back within the client's
  // reconnect_ms, or unreachable) has updated nothing: the client settles before the update. What
  // it moved is the data's position and the generators' draws, so those go back to the step's
  // start, and a run that saves checkpoints saves one there before the error goes on (naming it),
  // so that nothing trained is lost and --resume goes on exactly.
  StepStats step_or_save() {
    const int64_t steps_before = steps_done, epoch_before = epoch;
    const size_t next_before = next_micro_batch;
    const auto generators_before = generator_states();
    try {
      return step();
    } catch (const std::exception& e) {
      if (options.save_dir.empty() || steps_done == 0 || steps_done != steps_before) throw;
      if (epoch != epoch_before) plans = epoch_before == 0 ? std::vector<MicroBatchPlan>{} : plan_epoch(epoch_before);
      epoch = epoch_before;
      next_micro_batch = next_before;
      set_generator_states(generators_before);
      const auto dir = options.save_dir / ("checkpoint-" + std::to_string(steps_done));
      if (!fs::exists(dir / "trainer_state.json")) {
        save(dir);
        keep_checkpoints(options.save_dir, options.save_total_limit);
      }
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      TORCH_CHECK(false, error ? error->what_without_backtrace() : e.what(), "\n(step ", steps_done + 1,
                  " failed; the training of the ", steps_done, " steps before it is saved in ", dir.string(),
                  ", which --resume ", options.save_dir.string(), " goes on from)");
    }
  }

  StepStats step() {
    TORCH_CHECK(steps_done < total, "Trainer: all ", total, " steps are done");
    const auto start = std::chrono::steady_clock::now();
    if (next_micro_batch >= plans.size()) {
      ++epoch;
      plans = plan_epoch(epoch);
      next_micro_batch = 0;
    }
    const auto shape = gpu ? gpu->shape : std::nullopt;  // captured steps read one shape
    std::vector<MicroBatch> batches;
    for (int64_t k = 0; k < options.grad_accum && next_micro_batch < plans.size(); ++k) {
      batches.push_back(collate(data, plans[next_micro_batch++], options.batching, shape));
    }
    StepStats stats;
    stats.epoch = epoch;
    for (const auto& mb : batches) {
      stats.tokens += mb.num_tokens;
      stats.targets += mb.num_targets;
    }
    stats.learning_rate = warmup_cosine_learning_rate(steps_done, total, options.warmup_steps, options.learning_rate,
                                                      options.min_learning_rate);
    if (stats.targets == 0) {
      stats.loss = NAN;  // truncation left nothing to train on: no update
    } else {
      // [Executor restart] (client_runtime/client.cpp): a step whose calls ordered on the GPU lost
      // their results is done again; it updated nothing (the client settles before the update).
      redo_if_results_lost("step " + std::to_string(steps_done + 1),
                           [&] { gpu ? device_step(batches, stats) : host_step(batches, stats); });
    }
    stats.step = ++steps_done;
    if (stats.targets > 0 && hooks.after_update) hooks.after_update(stats.step);
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    history.push_back(stats);
    return stats;
  }

  // A step on the CPU: eager, with LibTorch's AdamW.
  void host_step(const std::vector<MicroBatch>& batches, StepStats& stats) {
    optimizer->zero_grad();
    // [Loss over an optimizer step]
    double loss = 0;
    for (const auto& batch : batches) {
      if (batch.num_targets == 0) continue;
      const auto mb = to_device(batch);
      auto part = causal_lm_loss(model_forward(lm, mb, packed), mb.labels, at::Reduction::Sum) /
                  static_cast<double>(stats.targets);
      part.backward();
      loss += part.item<double>();
    }
    if (hooks.extra_loss) {
      auto extra = hooks.extra_loss();
      extra.backward();
      loss += extra.item<double>();
    }
    lm.settle();  // a base-layer call that failed must not update the adapters
    stats.loss = loss;
    stats.grad_norm =
        torch::nn::utils::clip_grad_norm_(params, options.max_grad_norm > 0 ? options.max_grad_norm : INFINITY);
    for (auto& group : optimizer->param_groups()) group.options().set_lr(stats.learning_rate);
    optimizer->step();
  }

  // [Training on a GPU]: what a step reads and writes on the device, and the step itself.
  struct DeviceStep {
    std::unique_ptr<FusedAdamW> optimizer;
    at::Tensor learning_rate, inv_targets;  // [] fp32, written before each step
    at::Tensor loss, grad_norm;             // [] fp32, the step's results
    std::vector<MicroBatch> inputs;         // the step's micro-batches (captured: always the same tensors)
    std::optional<FixedShape> shape;        // captured: every micro-batch's
    MicroBatch padding;                     // captured: a micro-batch of padding rows (on the CPU)
    std::unique_ptr<StepGraph> graph;
  };

  std::vector<at::Tensor> defined_grads() const {
    std::vector<at::Tensor> grads;
    for (const auto& p : params) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    return grads;
  }

  // Forward and backward of the step's micro-batches: the gradients, and the loss on the device.
  void device_compute() {
    auto& g = *gpu;
    auto grads = defined_grads();
    if (!grads.empty()) at::_foreach_zero_(grads);
    g.loss.zero_();
    for (const auto& mb : g.inputs) {
      // [Loss over an optimizer step]
      auto part = causal_lm_loss(model_forward(lm, mb, packed), mb.labels, at::Reduction::Sum) * g.inv_targets;
      part.backward();
      g.loss.add_(part.detach());
    }
    if (hooks.extra_loss) {
      auto extra = hooks.extra_loss();
      extra.backward();
      g.loss.add_(extra.detach());
    }
  }

  // Clipping (as torch.nn.utils.clip_grad_norm_ computes it) and the optimizer's update.
  void device_apply() {
    auto& g = *gpu;
    auto grads = defined_grads();
    std::vector<at::Tensor> norms;
    for (const auto& n : at::_foreach_norm(grads)) norms.push_back(n.to(at::kFloat));
    auto total_norm = at::linalg_vector_norm(at::stack(norms), 2);
    g.grad_norm.copy_(total_norm);
    if (options.max_grad_norm > 0) {
      at::_foreach_mul_(grads, at::clamp_max((total_norm + 1e-6).reciprocal() * options.max_grad_norm, 1.0));
    }
    g.optimizer->step();
  }

  std::unique_ptr<DeviceStep> make_device_step() {
    auto g = std::make_unique<DeviceStep>();
    g->optimizer = make_fused_optimizer();
    const auto scalar = at::TensorOptions().dtype(at::kFloat).device(device);
    g->learning_rate = at::zeros({}, scalar);
    g->inv_targets = at::zeros({}, scalar);
    g->loss = at::zeros({}, scalar);
    g->grad_norm = at::zeros({}, scalar);
    g->optimizer->set_lr_tensor(g->learning_rate);
    g->graph = std::make_unique<StepGraph>([this] { device_compute(); }, [this] { device_apply(); }, lm.client, device,
                                           StepGraphOptions{.capture = options.capture});
    // Only captured steps need one shape: a client that cannot be captured trains unpadded.
    if (g->graph->captures()) {
      g->shape = FixedShape{options.batching.micro_batch_size, longest_row(data, options.batching)};
      g->padding = collate(data, {}, options.batching, g->shape);
      for (int64_t k = 0; k < options.grad_accum; ++k) g->inputs.push_back(to_device(g->padding));
    }
    return g;
  }

  // batches: in the fixed shape when captured.
  void device_step(const std::vector<MicroBatch>& batches, StepStats& stats) {
    auto& g = *gpu;
    if (g.shape) {
      // The same tensors every step: the new micro-batches are copied into them, a micro-batch of
      // padding where the step has fewer.
      for (size_t k = 0; k < g.inputs.size(); ++k) {
        const auto& mb = k < batches.size() ? batches[k] : g.padding;
        g.inputs[k].input_ids.copy_(mb.input_ids);
        g.inputs[k].attention_mask.copy_(mb.attention_mask);
        g.inputs[k].position_ids.copy_(mb.position_ids);
        g.inputs[k].labels.copy_(mb.labels);
      }
    } else {
      g.inputs.clear();
      for (const auto& mb : batches) {
        if (mb.num_targets > 0) g.inputs.push_back(to_device(mb));
      }
    }
    g.inv_targets.fill_(1.0 / static_cast<double>(stats.targets));
    g.learning_rate.fill_(stats.learning_rate);
    g.graph->run();
    stats.loss = g.loss.item<double>();
    stats.grad_norm = g.grad_norm.item<double>();
  }

  double evaluate(const TokenDataset& d) {
    check_vocab(d);
    const bool was_training = lm.module->is_training();
    lm.module->eval();
    at::NoGradGuard no_grad;
    double sum = 0;
    int64_t targets = 0;
    for (const auto& plan : plan_micro_batches(d, epoch_order(d.size(), 0, 0, /*shuffle=*/false), options.batching)) {
      auto mb = to_device(collate(d, plan, options.batching));
      if (mb.num_targets == 0) continue;
      sum += causal_lm_loss(model_forward(lm, mb, packed), mb.labels, at::Reduction::Sum).item<double>();
      targets += mb.num_targets;
    }
    lm.module->train(was_training);
    return targets > 0 ? sum / static_cast<double>(targets) : NAN;
  }

  // The generators a step draws from (dropout): the CPU's, and the model's GPU's on a GPU.
  std::vector<at::Generator> generators() const {
    std::vector<at::Generator> out = {at::detail::getDefaultCPUGenerator()};
    if (device.is_cuda()) out.push_back(at::globalContext().defaultGenerator(device));
    return out;
  }
  std::vector<at::Tensor> generator_states() const {
    std::vector<at::Tensor> states;
    for (auto& generator : generators()) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      states.push_back(generator.get_state());
    }
    return states;
  }
  void set_generator_states(const std::vector<at::Tensor>& states) {
    auto all = generators();
    for (size_t i = 0; i < all.size(); ++i) {
      std::lock_guard<std::mutex> lock(all[i].mutex());
      all[i].set_state(states[i]);
    }
  }

  void save(const fs::path& dir) const {
    // Written beside the target and renamed into place, so a crash never leaves half a checkpoint.
    fs::path partial = dir;
    partial += ".partial";
    fs::remove_all(partial);
    fs::create_directories(partial);
    if (save_adapter) {
      fs::create_directories(partial / "adapter");
      save_adapter(partial / "adapter");
    }
    std::vector<at::Tensor> values;
    for (const auto& p : params) values.push_back(p.detach().cpu().clone());
    torch::save(values, (partial / "trainable.pt").string());
    if (gpu) {
      std::vector<at::Tensor> state;
      for (const auto& t : gpu->optimizer->state()) state.push_back(t.cpu());
      torch::save(state, (partial / "optimizer.pt").string());
    } else {
      torch::save(*optimizer, (partial / "optimizer.pt").string());
    }
    torch::save(generator_states(), (partial / "rng_state.pt").string());
    nlohmann::json steps = nlohmann::json::array();
    for (const auto& s : history) {
      nlohmann::json j = {
          {"step", s.step},           {"epoch", s.epoch},   {"loss", s.loss},       {"learning_rate", s.learning_rate},
          {"grad_norm", s.grad_norm}, {"tokens", s.tokens}, {"targets", s.targets}, {"seconds", s.seconds}};
      if (s.eval_loss) j["eval_loss"] = *s.eval_loss;
      steps.push_back(j);
    }
    nlohmann::json state = {{"format", "symbiosis-trainer-1"},
                            {"step", steps_done},
                            {"total_steps", total},
                            {"epoch", epoch},
                            {"next_micro_batch", next_micro_batch},
                            {"num_trainable", params.size()},
                            {"settings", options_json(options, data)},
                            {"history", steps}};
    write_text(partial / "trainer_state.json", state.dump(2) + "\n");
    fs::remove_all(dir);
    fs::rename(partial, dir);
  }

  void load(const fs::path& dir) {
    const auto state_file = dir / "trainer_state.json";
    std::ifstream in(state_file);
    TORCH_CHECK(in, state_file.string(), ": cannot open (is ", dir.string(), " a trainer checkpoint?)");
    nlohmann::json state;
    try {
      state = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, state_file.string(), ": not valid JSON (", e.what(), ")");
    }
    try {
      TORCH_CHECK(state.value("format", "") == "symbiosis-trainer-1", state_file.string(), ": format is '",
                  state.value("format", ""), "', expected symbiosis-trainer-1");
      const auto saved = state.at("settings");
      const auto now = options_json(options, data);
      for (const auto& [key, value] : now.items()) {
        if (key == "max_steps" || key == "epochs") continue;  // the run may be extended ([Exact resume])
        TORCH_CHECK(key != "model_hash" || (saved.contains(key) && saved[key] == value), dir.string(),
                    " was trained on base model ", saved.contains(key) ? saved[key].dump() : "(not recorded)",
                    " but this model is ", value.dump(), "; resume on the checkpoint it was trained on");
        TORCH_CHECK(saved.contains(key) && saved[key] == value, state_file.string(), ": ", key, " is ",
                    saved.contains(key) ? saved[key].dump() : "missing", " in the checkpoint but ", value.dump(),
                    " now; resuming exactly needs the same settings and data");
      }
      TORCH_CHECK(state.at("num_trainable").get<size_t>() == params.size(), state_file.string(), ": num_trainable is ",
                  state.at("num_trainable").get<size_t>(), " but this model has ", params.size(),
                  " trainable tensors (attach the same adapter before loading)");
      std::vector<at::Tensor> values;
      torch::load(values, (dir / "trainable.pt").string());
      TORCH_CHECK(values.size() == params.size(), dir / "trainable.pt", ": holds ", values.size(),
                  " tensors, expected ", params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        TORCH_CHECK(values[i].sizes() == params[i].sizes(), dir / "trainable.pt", ": tensor ", i, " has shape ",
                    values[i].sizes(), " but the model's has ", params[i].sizes());
      }
      std::unique_ptr<torch::optim::AdamW> loaded_optimizer;
      std::vector<at::Tensor> loaded_state;
      if (gpu) {
        torch::load(loaded_state, (dir / "optimizer.pt").string());
        TORCH_CHECK(loaded_state.size() == 3 * params.size(), dir / "optimizer.pt", ": holds ", loaded_state.size(),
                    " tensors, expected ", 3 * params.size(), " (FusedAdamW's state, three per trainable tensor)");
      } else {
        loaded_optimizer = make_optimizer();  // over the same tensors; loading changes no tensor values
        torch::load(*loaded_optimizer, (dir / "optimizer.pt").string());
      }
      std::vector<at::Tensor> rng;
      torch::load(rng, (dir / "rng_state.pt").string());
      TORCH_CHECK(rng.size() == generator_states().size(), dir / "rng_state.pt", ": holds ", rng.size(),
                  " generator states, expected ", generator_states().size(),
                  " (the CPU's, and the GPU's when training on a GPU)");
      std::vector<StepStats> steps;
      for (const auto& j : state.at("history")) {
        StepStats s;
        s.step = j.at("step");
        s.epoch = j.at("epoch");
        s.loss = j.at("loss").is_number() ? j.at("loss").get<double>() : NAN;
        s.learning_rate = j.at("learning_rate");
        s.grad_norm = j.at("grad_norm");
        s.tokens = j.at("tokens");
        s.targets = j.at("targets");
        s.seconds = j.at("seconds");
        if (j.contains("eval_loss")) s.eval_loss = j.at("eval_loss").get<double>();
        steps.push_back(s);
      }
      const int64_t saved_epoch = state.at("epoch");
      const size_t saved_next = state.at("next_micro_batch");
      auto saved_plans = plan_epoch(saved_epoch);
      TORCH_CHECK(saved_next <= saved_plans.size(), state_file.string(), ": next_micro_batch is ", saved_next,
                  " but epoch ", saved_epoch, " has ", saved_plans.size(), " micro-batches");
      // Every check passed: change the trainer.
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
      }
      if (gpu) {
        gpu->optimizer->load_state(loaded_state);
      } else {
        optimizer = std::move(loaded_optimizer);
      }
      set_generator_states(rng);
      steps_done = state.at("step");
      epoch = saved_epoch;
      next_micro_batch = saved_next;
      plans = std::move(saved_plans);
      history = std::move(steps);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, state_file.string(), ": ", e.what());
    }
  }

  std::vector<StepStats> train(int64_t steps) {
    const int64_t first = steps_done;
    const int64_t last = steps < 0 ? total : std::min(total, steps_done + steps);
    std::vector<StepStats> ran;
    std::optional<ProgressDisplay> display;
    if (options.progress) display.emplace(first, total);
    const auto start = std::chrono::steady_clock::now();
    int64_t tokens = 0;
    while (steps_done < last) {
      auto stats = step_or_save();
      tokens += stats.tokens;
      const bool stopped = options.stop != nullptr && options.stop->load();
      const bool end = steps_done == last || stopped;
      if (eval_data && ((options.eval_every > 0 && steps_done % options.eval_every == 0) || end)) {
        stats.eval_loss = evaluate(*eval_data);
        history.back().eval_loss = stats.eval_loss;
      }
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (display) display->update(stats, elapsed, tokens);
      if (!options.save_dir.empty() && ((options.save_every > 0 && steps_done % options.save_every == 0) || end)) {
        save(options.save_dir / ("checkpoint-" + std::to_string(steps_done)));
        keep_checkpoints(options.save_dir, options.save_total_limit);
      }
      ran.push_back(stats);
      if (stopped) break;
    }
    return ran;
  }

  CausalLM lm;
  std::vector<at::Tensor> params;
  TokenDataset data;
  TrainerOptions options;
  AdapterSaver save_adapter;
  std::optional<TokenDataset> eval_data;
  bool packed = false;
  at::Device device = at::kCPU;
  std::unique_ptr<torch::optim::AdamW> optimizer;  // on the CPU
  std::unique_ptr<DeviceStep> gpu;                 // on a GPU ([Training on a GPU])
  TrainerHooks hooks;
  int64_t total = 0;  // optimizer steps in the schedule
  int64_t steps_done = 0;
  int64_t epoch = 0;                  // the epoch `plans` belongs to
  std::vector<MicroBatchPlan> plans;  // this epoch's micro-batches
  size_t next_micro_batch = 0;        // index into plans
  std::vector<StepStats> history;
};

Trainer::Trainer(CausalLM model, std::vector<at::Tensor> parameters, TokenDataset train, TrainerOptions options,
                 AdapterSaver save_adapter)
    : impl_(std::make_unique<Impl>(std::move(model), std::move(parameters), std::move(train), std::move(options),
                                   std::move(save_adapter))) {}
Trainer::~Trainer() = default;

void Trainer::set_hooks(TrainerHooks hooks) { impl_->hooks = std::move(hooks); }

void Trainer::set_eval_data(TokenDataset eval) {
  impl_->check_vocab(eval);
  impl_->eval_data = std::move(eval);
}
StepStats Trainer::step() { return impl_->step(); }
std::vector<StepStats> Trainer::train(int64_t steps) { return impl_->train(steps); }
double Trainer::evaluate() {
  TORCH_CHECK(impl_->eval_data, "Trainer::evaluate: no eval data (set_eval_data)");
  return impl_->evaluate(*impl_->eval_data);
}
double Trainer::evaluate(const TokenDataset& data) { return impl_->evaluate(data); }
void Trainer::save_checkpoint(const fs::path& dir) const { impl_->save(dir); }
void Trainer::load_checkpoint(const fs::path& dir) { impl_->load(dir); }
int64_t Trainer::steps_done() const { return impl_->steps_done; }
int64_t Trainer::total_steps() const { return impl_->total; }
const std::vector<StepStats>& Trainer::history() const { return impl_->history; }
const std::vector<at::Tensor>& Trainer::parameters() const { return impl_->params; }

std::vector<fs::path> checkpoints_in(const fs::path& save_dir) {
  static const std::regex name("checkpoint-([0-9]+)");
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const auto& entry : fs::directory_iterator(save_dir)) {
    std::smatch m;
    const auto file = entry.path().filename().string();
    if (!std::regex_match(file, m, name) || !fs::exists(entry.path() / "trainer_state.json")) continue;
    found.emplace_back(std::stoll(m[1]), entry.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> paths;
  for (auto& [step, path] : found) paths.push_back(std::move(path));
  return paths;
}

fs::path adapter_in(const fs::path& path) {
  if (fs::exists(path / "adapter_config.json")) return path;
  if (fs::exists(path / "adapter" / "adapter_config.json")) return path / "adapter";
  const auto found = fs::is_directory(path) ? checkpoints_in(path) : std::vector<fs::path>{};
  TORCH_CHECK(!found.empty() && fs::exists(found.back() / "adapter" / "adapter_config.json"), path.string(),
              ": not a PEFT adapter; expected a folder with adapter_config.json, a checkpoint of "
              "symbiosis-finetune (its adapter/), or a run's --save-dir (its newest checkpoint's adapter/)");
  return found.back() / "adapter";
}

fs::path latest_checkpoint(const fs::path& save_dir) {
  if (fs::exists(save_dir / "trainer_state.json")) return save_dir;
  TORCH_CHECK(fs::is_directory(save_dir), save_dir.string(), ": no such checkpoint directory");
  const auto found = checkpoints_in(save_dir);
  TORCH_CHECK(!found.empty(), save_dir.string(),
              ": holds no trainer checkpoint (checkpoint-<step>/trainer_state.json)");
  return found.back();
}

}  // namespace symbiosis
