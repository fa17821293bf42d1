// symbiosis-finetune: fine-tune a PEFT adapter (LoRA, DoRA, AdaLoRA, IA3, prompt tuning, P-tuning or
// prefix tuning) on a JSON Lines dataset of text or token ids, against a running executor (split)
// or with the base layers in-process (--monolithic), on the CPU or the tenant's GPU (--device,
// --dtype; captured steps and the fused optimizer there: [Training on a GPU] in
// training/trainer.h). Text is tokenized with the checkpoint's tokenizer ([Text examples] in
// training/dataset.h). Flags map one to one onto TrainerOptions, MicroBatchOptions and the methods'
// configs (peft/). Progress goes to stderr; a summary line per evaluation and at the end to stdout.
// Checkpoints land in --save-dir (by default a new folder under symbiosis-runs/) as
// checkpoint-<step>/ (adapter/ inside is the PEFT adapter to serve), latest/ linking to the newest;
// the first SIGINT or SIGTERM saves one and stops ([Stopping]); --resume continues one exactly, with the adapter as it was saved: a method flag given
// with --resume must agree with it, and --steps or --epochs may extend the run.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include <symbiosis/client.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>
#include <symbiosis/text.h>
#include <symbiosis/training.h>

#include "examples/tenant_flags.h"

using namespace symbiosis;
namespace fs = std::filesystem;

namespace {

const char* const kMethods = "lora, dora, adalora, ia3, prompt, p-tuning or prefix";

struct Settings {
  std::string model;
  examples::TenantFlags connection{.tenant = "finetune"};
  std::string device = "cpu";
  std::string dtype = "fp32";
  bool no_capture = false;
  std::string train_file, eval_file;
  std::string method = "lora";
  LoraConfig lora;
  std::string lora_targets;  // none: PEFT's defaults for the model's type
  AdaLoraConfig adalora;
  int64_t virtual_tokens = 20;
  bool prefix_projection = false;
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

// The method's name on the command line for a saved adapter's PEFT type.
std::string method_of(const std::string& peft_type, const fs::path& adapter) {
  if (peft_type == "LORA") return read_lora_config(adapter).use_dora ? "dora" : "lora";
  if (peft_type == "ADALORA") return "adalora";
  if (peft_type == "IA3") return "ia3";
  if (peft_type == "PROMPT_TUNING") return "prompt";
  if (peft_type == "P_TUNING") return "p-tuning";
  if (peft_type == "PREFIX_TUNING") return "prefix";
  return peft_type;
}

// What --resume keeps from the checkpoint: a method flag given now must say the same.
void check_resumed_flags(const CLI::App& app, const Settings& s, const std::string& method, const fs::path& adapter) {
  const auto refuse = [&](const std::string& flag, const std::string& given, const std::string& saved) {
    TORCH_CHECK(given == saved, flag, " is ", given, " but the adapter being resumed (", adapter.string(), ") has ",
                saved, "; --resume continues the saved adapter (leave ", flag, " out, or start a new run)");
  };
  if (app.count("--method")) refuse("--method", s.method, method);
  if (method != "lora" && method != "dora") return;
  const auto saved = read_lora_config(adapter);
  if (app.count("--lora-r")) refuse("--lora-r", std::to_string(s.lora.r), std::to_string(saved.r));
  if (app.count("--lora-alpha") && s.lora.alpha != saved.alpha) {
    refuse("--lora-alpha", std::to_string(s.lora.alpha), std::to_string(saved.alpha));
  }
  if (app.count("--lora-targets")) {
    auto given = split_list(s.lora_targets), kept = saved.target_modules;
    std::sort(given.begin(), given.end());
    std::sort(kept.begin(), kept.end());
    std::string a, b;
    for (const auto& t : given) a += (a.empty() ? "" : ",") + t;
    for (const auto& t : kept) b += (b.empty() ? "" : ",") + t;
    refuse("--lora-targets", a, b);
  }
  if (app.count("--rslora")) refuse("--rslora", "on", saved.use_rslora ? "on" : "off");
}

struct Adapter {
  std::string method;
  std::vector<at::Tensor> parameters;
  AdapterSaver save;
  TrainerHooks hooks;
  std::shared_ptr<AdaLoraAllocator> allocator;
};

// --lora-targets, each of which must name a layer, or PEFT's defaults for the model's type.
std::vector<std::string> lora_targets(const Settings& s, torch::nn::Module& model) {
  if (s.lora_targets.empty()) return default_lora_targets(model);
  const auto targets = split_list(s.lora_targets);
  require_every_lora_target_matches(model, targets);
  return targets;
}

// A new adapter of the method the flags name.
Adapter new_adapter(Settings& s, const CausalLM& lm, int64_t total_steps) {
  auto module = lm.module;
  Adapter a{.method = s.method};
  if (s.method == "lora" || s.method == "dora") {
    s.lora.target_modules = lora_targets(s, *module);
    s.lora.use_dora = s.method == "dora";
    s.lora.validate();
    a.parameters = add_lora(*module, s.lora);
  } else if (s.method == "adalora") {
    s.adalora.target_modules = lora_targets(s, *module);
    s.adalora.total_step = total_steps;
    s.adalora.validate();
    a.parameters = add_adalora(*module, s.adalora);
  } else if (s.method == "ia3") {
    a.parameters = add_ia3(*module);
  } else if (s.method == "prompt") {
    a.parameters = add_prompt_tuning(*module, {.num_virtual_tokens = s.virtual_tokens});
  } else if (s.method == "p-tuning") {
    a.parameters = add_p_tuning(*module, {.num_virtual_tokens = s.virtual_tokens});
  } else if (s.method == "prefix") {
    a.parameters =
        add_prefix_tuning(*module, {.num_virtual_tokens = s.virtual_tokens, .prefix_projection = s.prefix_projection});
  } else {
    TORCH_CHECK(false, "--method: '", s.method, "' is not one of ", kMethods);
  }
  return a;
}

// How the adapter is saved, and what its method adds to a step (AdaLoRA: the orthogonal
// regularization and the rank allocator, as PEFT's AdaLoraModel and its Trainer callback do).
void attach_saving(Adapter& a, const Settings& s, const CausalLM& lm, const fs::path& resumed) {
  auto module = lm.module;
  if (a.method == "lora" || a.method == "dora") {
    const LoraConfig lora = resumed.empty() ? s.lora : read_lora_config(resumed);
    a.save = [module, lora](const fs::path& dir) { save_lora(*module, lora, dir); };
  } else if (a.method == "adalora") {
    a.allocator = std::make_shared<AdaLoraAllocator>(*module, s.adalora);
    auto allocator = a.allocator;
    const AdaLoraConfig config = s.adalora;
    a.hooks.extra_loss = [module, config] { return adalora_orthogonal_regularization(*module, config); };
    a.hooks.after_update = [allocator](int64_t step) { allocator->update_and_allocate(step); };
    a.save = [module, allocator](const fs::path& dir) { save_adalora(*module, allocator->config(), dir); };
  } else if (a.method == "ia3") {
    const IA3Config ia3 = resumed.empty() ? IA3Config{} : read_ia3_config(resumed);
    a.save = [module, ia3](const fs::path& dir) { save_ia3(*module, ia3, dir); };
  } else {
    a.save = [module](const fs::path& dir) { save_prompt_learning(*module, dir); };
  }
  // The base it was trained on, as PEFT records it: AutoPeftModelForCausalLM.from_pretrained(adapter)
  // then finds it (null sent it to the Hub for a model named None).
  auto base = fs::absolute(s.model).lexically_normal();
  if (!base.has_filename()) base = base.parent_path();  // "dir/"
  a.save = [save = std::move(a.save), base = base.string()](const fs::path& dir) {
    save(dir);
    record_base_model(dir, base);
  };
}

// [Stopping]: the first SIGINT or SIGTERM asks the trainer to stop after the step in progress,
// saving its checkpoint; the handlers then go, so that a second ends the program at once.
std::atomic<bool> stop_requested{false};
std::atomic<int> stopped_by{0};

extern "C" void on_stop_signal(int signal) {
  stopped_by.store(signal);
  stop_requested.store(true);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  constexpr char kSaid[] = "symbiosis-finetune: stopping after this step, with a checkpoint (again to stop at once)\n";
  [[maybe_unused]] const auto written = ::write(STDERR_FILENO, kSaid, sizeof(kSaid) - 1);
}

void on_stop_signals() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

// Where a run without --save-dir saves: a new folder of this one, named by the local time.
fs::path default_save_dir() {
  const std::time_t now = std::time(nullptr);
  char name[32];
  std::strftime(name, sizeof(name), "%Y%m%d-%H%M%S", std::localtime(&now));
  fs::path dir = fs::path("symbiosis-runs") / name;
  for (int i = 2; fs::exists(dir); ++i)
    dir = fs::path("symbiosis-runs") / (std::string(name) + "-" + std::to_string(i));
  return dir;
}

int run(Settings& s, const CLI::App& app) {
  const at::Device device = examples::require_device(s.device);
  auto checkpoint = Checkpoint::open(s.model);
  std::shared_ptr<Client> client;
  if (!s.connection.monolithic) {
    auto options = examples::client_options(s.connection, *checkpoint);
    options.device = s.device;
    client = Client::connect(options);
  }
  auto lm = open_causal_lm(*checkpoint, client, {parse_dtype_name(s.dtype), device});
  const auto tokenizer = Tokenizer::in_directory(checkpoint->dir());  // null: the dataset refuses text
  auto train_data = TokenDataset::from_jsonl(s.train_file, tokenizer.get());

  s.trainer.batching.mode = s.packing ? BatchingMode::kPacking : BatchingMode::kPadding;
  s.trainer.shuffle = !s.no_shuffle;
  s.trainer.progress = !s.no_progress;
  s.trainer.capture = !s.no_capture;
  s.trainer.model_hash = checkpoint->model_hash();

  // The adapter: as saved in the checkpoint being resumed, or new from the flags.
  at::manual_seed(s.trainer.seed);  // adapter initialization, then the dropout stream
  Adapter adapter;
  fs::path resume_from, resumed_adapter;
  if (!s.resume.empty()) {
    resume_from = latest_checkpoint(s.resume);
    resumed_adapter = resume_from / "adapter";
    auto loaded = load_peft_adapter(*lm.module, resumed_adapter);
    adapter.method = method_of(loaded.peft_type, resumed_adapter);
    TORCH_CHECK(adapter.method != "adalora", "--resume: ", resumed_adapter.string(),
                " is an AdaLoRA adapter, whose rank allocator's statistics a checkpoint does not hold; an AdaLoRA run "
                "cannot be resumed exactly (start a new run, or fine-tune the saved adapter as LoRA)");
    check_resumed_flags(app, s, adapter.method, resumed_adapter);
    adapter.parameters = loaded.parameters;
  } else {
    adapter = new_adapter(s, lm, planned_steps(train_data, s.trainer));
  }
  attach_saving(adapter, s, lm, resumed_adapter);

  Trainer trainer(lm, adapter.parameters, std::move(train_data), s.trainer, adapter.save);
  trainer.set_hooks(adapter.hooks);
  if (!s.eval_file.empty()) trainer.set_eval_data(TokenDataset::from_jsonl(s.eval_file, tokenizer.get()));
  if (!resume_from.empty()) {
    trainer.load_checkpoint(resume_from);
    std::fprintf(stderr, "[%s] resumed %s at step %lld of %lld\n", s.connection.tenant.c_str(), resume_from.c_str(),
                 (long long)trainer.steps_done(), (long long)trainer.total_steps());
  }
  std::fprintf(stderr, "[%s] %s on %s (%s), %zu trainable tensors, %lld steps, %s\n", s.connection.tenant.c_str(),
               s.connection.monolithic ? "monolithic" : ("split on " + s.connection.executor).c_str(), s.device.c_str(),
               s.dtype.c_str(), adapter.parameters.size(), (long long)trainer.total_steps(), adapter.method.c_str());
  std::fprintf(stderr,
               "[%s] checkpoints go to %s (a first Ctrl-C or SIGTERM saves one and stops; a second stops at once)\n",
               s.connection.tenant.c_str(), s.trainer.save_dir.c_str());
  const auto ran = trainer.train();
  for (const auto& step : ran) {
    if (step.eval_loss) std::printf("step %lld eval_loss %.6f\n", (long long)step.step, *step.eval_loss);
  }
  TORCH_CHECK(!trainer.history().empty(), "no step was run");
  const auto& last = trainer.history().back();
  const int signal = trainer.done() ? 0 : stopped_by.load();
  std::printf("%s: step %lld loss %.6f", signal != 0 ? "stopped" : "done", (long long)last.step, last.loss);
  if (last.eval_loss) std::printf(" eval_loss %.6f", *last.eval_loss);
  std::printf(" checkpoint %s\n", (s.trainer.save_dir / ("checkpoint-" + std::to_string(last.step))).c_str());
  if (signal == 0) return 0;
  std::fprintf(stderr, "[%s] stopped by %s at step %lld of %lld; --resume %s goes on\n", s.connection.tenant.c_str(),
               signal == SIGINT ? "SIGINT" : "SIGTERM", (long long)last.step, (long long)trainer.total_steps(),
               s.trainer.save_dir.c_str());
  return 128 + signal;  // as a shell reports a program the signal ended
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  auto& t = s.trainer;
  CLI::App app{"symbiosis-finetune: fine-tune a PEFT adapter on text or token ids, against a shared executor"};
  app.add_option("--model", s.model, "the checkpoint directory (the executor serves the same)")->required();
  examples::add_tenant_flags(app, s.connection, /*monolithic_flag=*/true);
  app.add_option("--device", s.device, "where this tenant's model computes: cpu or cuda:N")->capture_default_str();
  app.add_option("--dtype", s.dtype, "this tenant's model dtype: fp32, bf16 or fp16")->capture_default_str();
  app.add_flag("--no-capture", s.no_capture, "on a GPU: eager steps instead of captured ones");
  app.add_option("--train", s.train_file,
                 "training data, JSON Lines of {\"text\": ...}, {\"prompt\": ..., \"completion\": ...} (loss on the "
                 "completion) or {\"input_ids\": [...], \"labels\": [...]?}")
      ->required();
  app.add_option("--eval", s.eval_file, "held-out data in the same format");
  app.add_option("--method", s.method, std::string("the PEFT method: ") + kMethods)->capture_default_str();
  app.add_option("--lora-r", s.lora.r, "LoRA rank")->capture_default_str();
  app.add_option("--lora-alpha", s.lora.alpha, "LoRA alpha")->capture_default_str();
  app.add_option("--lora-dropout", s.lora.dropout, "LoRA dropout")->capture_default_str();
  app.add_option("--lora-targets", s.lora_targets,
                 "comma-separated target modules, or all-linear (default: PEFT's for the model type: q_proj,v_proj for "
                 "the Llama family, c_attn for GPT-2 and StarCoder)");
  app.add_flag("--rslora", s.lora.use_rslora, "scale by alpha/sqrt(r)");
  app.add_option("--adalora-init-r", s.adalora.init_r, "AdaLoRA: every layer's starting rank")->capture_default_str();
  app.add_option("--adalora-target-r", s.adalora.target_r, "AdaLoRA: the average rank the budget ends at")
      ->capture_default_str();
  app.add_option("--adalora-tinit", s.adalora.tinit, "AdaLoRA: steps before the budget falls")->capture_default_str();
  app.add_option("--adalora-tfinal", s.adalora.tfinal, "AdaLoRA: last steps with the final allocation")
      ->capture_default_str();
  app.add_option("--adalora-delta-t", s.adalora.deltaT, "AdaLoRA: steps between allocations")->capture_default_str();
  app.add_option("--virtual-tokens", s.virtual_tokens, "prompt, p-tuning, prefix: virtual tokens")
      ->capture_default_str();
  app.add_flag("--prefix-projection", s.prefix_projection, "prefix: the reparametrization MLP");
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
  app.add_option("--save-dir", save_dir,
                 "checkpoints go here as checkpoint-<step>/, with latest/ linking to the newest (default: "
                 "symbiosis-runs/<date>-<time>/ in this folder)");
  app.add_option("--save-total-limit", t.save_total_limit, "keep only the newest N checkpoints (0: all)")
      ->capture_default_str();
  app.add_option("--resume", s.resume, "a checkpoint, or a --save-dir (its newest checkpoint), to continue exactly");
  app.add_flag("--no-progress", s.no_progress, "no progress display");
  app.add_option("--threads", s.threads, "CPU threads of this process")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // [Inference first on the GPU] (client_runtime/training/step_graph.cpp): under MPS, this job's
  // kernels yield to inference tenants' (MPS client priority, read when CUDA starts; one set in the
  // environment wins).
  ::setenv("CUDA_MPS_CLIENT_PRIORITY", "1", /*overwrite=*/0);
  t.save_dir = save_dir.empty() ? default_save_dir() : fs::path(save_dir);
  t.stop = &stop_requested;
  on_stop_signals();
  at::set_num_threads(s.threads);
  return examples::report_errors(s.connection, [&] { return run(s, app); });
}
