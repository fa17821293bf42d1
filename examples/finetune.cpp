// symbiosis-finetune: fine-tune a PEFT adapter (LoRA or IA3) on a JSON Lines dataset of token
// ids, against a running executor (split) or with the base layers in-process (--monolithic).
// Flags map one to one onto TrainerOptions, MicroBatchOptions and LoraConfig (training/trainer.h,
// training/dataset.h, peft/lora.h). Progress goes to stderr; a summary line per evaluation and at the end to
// stdout. Checkpoints land in --save-dir as checkpoint-<step>/ (adapter/ inside is the PEFT adapter
// to serve); --resume continues one exactly, with the adapter as it was saved (the method flags
// are then ignored).
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <sstream>

#include <symbiosis/client.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>
#include <symbiosis/training.h>

#include "examples/tenant_flags.h"

using namespace symbiosis;
namespace fs = std::filesystem;

namespace {

struct Settings {
  std::string model;
  examples::TenantFlags connection{.tenant = "finetune"};
  std::string train_file, eval_file;
  std::string method = "lora";
  LoraConfig lora;
  std::string lora_targets = "q_proj,v_proj";
  std::string resume;
  bool packing = false;
  bool no_shuffle = false;
  bool no_progress = false;
  int threads = 1;
  TrainerOptions trainer;
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int run(Settings& s) {
  auto checkpoint = Checkpoint::open(s.model);
  std::shared_ptr<Client> client;
  if (!s.connection.monolithic) client = Client::connect(examples::client_options(s.connection, *checkpoint));
  auto lm = open_causal_lm(*checkpoint, client);

  // The adapter: as saved in the checkpoint being resumed, or new from the flags.
  std::vector<at::Tensor> parameters;
  AdapterSaver save_adapter;
  fs::path resume_from;
  at::manual_seed(s.trainer.seed);  // adapter initialization, then the dropout stream
  std::string method = s.method;
  if (!s.resume.empty()) {
    resume_from = latest_checkpoint(s.resume);
    auto loaded = load_peft_adapter(*lm.module, resume_from / "adapter");
    parameters = loaded.parameters;
    method = loaded.peft_type == "LORA" ? "lora" : loaded.peft_type == "IA3" ? "ia3" : loaded.peft_type;
    if (method == "lora") s.lora = read_lora_config(resume_from / "adapter");
  } else if (method == "lora") {
    s.lora.target_modules = split_list(s.lora_targets);
    s.lora.validate();
    parameters = add_lora(*lm.module, s.lora);
  } else if (method == "ia3") {
    parameters = add_ia3(*lm.module);
  }
  auto module = lm.module;
  if (method == "lora") {
    const LoraConfig lora = s.lora;
    save_adapter = [module, lora](const fs::path& dir) { save_lora(*module, lora, dir); };
  } else if (method == "ia3") {
    const IA3Config ia3 = s.resume.empty() ? IA3Config{} : read_ia3_config(resume_from / "adapter");
    save_adapter = [module, ia3](const fs::path& dir) { save_ia3(*module, ia3, dir); };
  } else {
    TORCH_CHECK(false, "--method: '", method, "' is not supported here (lora or ia3)");
  }

  s.trainer.batching.mode = s.packing ? BatchingMode::kPacking : BatchingMode::kPadding;
  s.trainer.shuffle = !s.no_shuffle;
  s.trainer.progress = !s.no_progress;
  Trainer trainer(lm, parameters, TokenDataset::from_jsonl(s.train_file), s.trainer, save_adapter);
  if (!s.eval_file.empty()) trainer.set_eval_data(TokenDataset::from_jsonl(s.eval_file));
  if (!resume_from.empty()) {
    trainer.load_checkpoint(resume_from);
    std::fprintf(stderr, "[%s] resumed %s at step %lld of %lld\n", s.connection.tenant.c_str(), resume_from.c_str(),
                 (long long)trainer.steps_done(), (long long)trainer.total_steps());
  }
  std::fprintf(stderr, "[%s] %s, %zu trainable tensors, %lld steps, %s\n", s.connection.tenant.c_str(),
               s.connection.monolithic ? "monolithic" : ("split on " + s.connection.executor).c_str(), parameters.size(),
               (long long)trainer.total_steps(), method.c_str());
  const auto ran = trainer.train();
  for (const auto& step : ran) {
    if (step.eval_loss) std::printf("step %lld eval_loss %.6f\n", (long long)step.step, *step.eval_loss);
  }
  const auto& last = trainer.history().back();
  std::printf("done: step %lld loss %.6f", (long long)last.step, last.loss);
  if (last.eval_loss) std::printf(" eval_loss %.6f", *last.eval_loss);
  if (!s.trainer.save_dir.empty()) {
    std::printf(" checkpoint %s", (s.trainer.save_dir / ("checkpoint-" + std::to_string(last.step))).c_str());
  }
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  auto& t = s.trainer;
  CLI::App app{"symbiosis-finetune: fine-tune a PEFT adapter on token ids, against a shared executor"};
  app.add_option("--model", s.model, "the checkpoint directory (the executor serves the same)")->required();
  examples::add_tenant_flags(app, s.connection, /*monolithic_flag=*/true);
  app.add_option("--train", s.train_file, "training data: JSON Lines of {\"input_ids\": [...], \"labels\": [...]?}")
      ->required();
  app.add_option("--eval", s.eval_file, "held-out data in the same format");
  app.add_option("--method", s.method, "lora or ia3")->capture_default_str();
  app.add_option("--lora-r", s.lora.r, "LoRA rank")->capture_default_str();
  app.add_option("--lora-alpha", s.lora.alpha, "LoRA alpha")->capture_default_str();
  app.add_option("--lora-dropout", s.lora.dropout, "LoRA dropout")->capture_default_str();
  app.add_option("--lora-targets", s.lora_targets, "comma-separated target modules, or all-linear")->capture_default_str();
  app.add_flag("--rslora", s.lora.use_rslora, "scale by alpha/sqrt(r)");
  app.add_option("--lr", t.learning_rate, "peak learning rate")->capture_default_str();
  app.add_option("--min-lr", t.min_learning_rate, "learning rate at the end of the cosine")->capture_default_str();
  app.add_option("--warmup", t.warmup_steps, "linear warm-up steps")->capture_default_str();
  app.add_option("--weight-decay", t.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--clip", t.max_grad_norm, "clip the gradient norm to this (0: off)")->capture_default_str();
  app.add_option("--steps", t.max_steps, "optimizer steps (0: --epochs passes)")->capture_default_str();
  app.add_option("--epochs", t.epochs, "passes over the data when --steps is 0")->capture_default_str();
  app.add_option("--micro-batch", t.batching.micro_batch_size, "rows per micro-batch")->capture_default_str();
  app.add_option("--grad-accum", t.grad_accum, "micro-batches per optimizer step")->capture_default_str();
  app.add_flag("--packing", s.packing, "pack examples into rows of --pack-length tokens (see training/dataset.h)");
  app.add_option("--pack-length", t.batching.pack_length, "tokens per packed row")->capture_default_str();
  app.add_option("--max-length", t.batching.max_length, "cut examples to this many tokens (0: no limit)")
      ->capture_default_str();
  app.add_option("--seed", t.seed, "adapter initialization, data order and dropout")->capture_default_str();
  app.add_flag("--no-shuffle", s.no_shuffle, "keep the file's order");
  app.add_option("--eval-every", t.eval_every, "evaluate every N steps (and at the end)")->capture_default_str();
  app.add_option("--save-every", t.save_every, "checkpoint every N steps (and at the end)")->capture_default_str();
  std::string save_dir;
  app.add_option("--save-dir", save_dir, "checkpoints go here as checkpoint-<step>/");
  app.add_option("--resume", s.resume, "a checkpoint, or a --save-dir (its newest checkpoint), to continue exactly");
  app.add_flag("--no-progress", s.no_progress, "no progress display");
  app.add_option("--threads", s.threads, "CPU threads of this process")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  t.save_dir = save_dir;
  at::set_num_threads(s.threads);
  return examples::report_errors(s.connection, [&] { return run(s); });
}
