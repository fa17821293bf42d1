// The tenant trainer (client_runtime/training/trainer.h, dataset.h): dataset parsing and its refusals,
// batching layouts, the learning-rate schedule, gradient accumulation equal to one large batch,
// exact resume from a checkpoint against an executor, split training equal to monolithic, and the
// symbiosis-finetune program end to end.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <thread>

#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/training/loss.h"
#include "client_runtime/text/tokenizer.h"
#include "client_runtime/training/trainer.h"
#include "tests/client_runtime/text/reference_tokenizers.h"
#include "tests/python_reference.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::relative_error;

fs::path write_file(const fs::path& dir, const std::string& name, const std::string& text) {
  auto path = dir / name;
  std::ofstream(path) << text;
  return path;
}

// Random examples of varying lengths, some with a prompt part masked out of the labels.
std::vector<TokenExample> random_examples(int64_t count, uint64_t seed, int64_t min_len = 3, int64_t max_len = 12) {
  at::manual_seed(seed);
  std::vector<TokenExample> examples;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = at::randint(min_len, max_len + 1, {1}).item<int64_t>();
    auto ids = at::randint(0, 256, {n}, at::kLong);
    TokenExample e;
    e.input_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
    if (i % 2 == 1) {
      e.labels = e.input_ids;
      e.labels[0] = e.labels[1] = kIgnoreIndex;  // a "prompt" not trained on
    }
    examples.push_back(std::move(e));
  }
  return examples;
}

// ---- dataset -------------------------------------------------------------------------------

TEST(TokenDatasetTest, ReadsJsonLinesWithDefaultLabelsAndSkipsBlankLines) {
  auto dir = testing::temp_dir("trainer-data");
  auto file = write_file(dir, "train.jsonl",
                         "{\"input_ids\": [5, 6, 7], \"text\": \"ignored\"}\n"
                         "\n"
                         "{\"input_ids\": [1, 2, 3, 4], \"labels\": [-100, -100, 3, 4]}\n");
  auto data = TokenDataset::from_jsonl(file);
  ASSERT_EQ(data.size(), 2u);
  EXPECT_EQ(data[0].labels, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(data[1].labels, (std::vector<int64_t>{-100, -100, 3, 4}));
  EXPECT_EQ(data[1].line, 3);
  EXPECT_EQ(data.where(1), file.string() + ":3");
  EXPECT_EQ(data.num_tokens(), 7);
  EXPECT_EQ(data.max_token_id(), 7);
}

TEST(TokenDatasetTest, RefusalsNameTheFileLineAndField) {
  auto dir = testing::temp_dir("trainer-bad");
  struct Case {
    std::string line, expected;
  };
  const std::vector<Case> cases = {
      {"{\"input_ids\": [1, 2", ":2: not valid JSON"},
      {"[1, 2, 3]", ":2: expected a JSON object"},
      {"{\"labels\": [1, 2]}", ":2: input_ids: missing"},
      {"{\"input_ids\": \"1 2 3\"}", ":2: input_ids: expected an array of token ids, got string"},
      {"{\"input_ids\": [1, 2, 3.5]}", ":2: input_ids[2]: expected a token id (a non-negative integer), got 3.5"},
      {"{\"input_ids\": [1, -100, 3]}", ":2: input_ids[1]: expected a token id"},
      {"{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}", ":2: labels: has 2 entries, but input_ids has 3"},
      {"{\"input_ids\": [1, 2, 3], \"labels\": [1, -5, 3]}", ":2: labels[1]: expected a token id or -100, got -5"},
      {"{\"input_ids\": [7]}", ":2: labels: nothing to train on"},
      {"{\"input_ids\": [1, 2], \"labels\": [1, -100]}", ":2: labels: nothing to train on"},
      {"{\"input_ids\": []}", ":2: input_ids: is empty"},
  };
  for (const auto& c : cases) {
    auto file = write_file(dir, "bad.jsonl", "{\"input_ids\": [1, 2]}\n" + c.line + "\n");
    const auto message = error_of([&] { TokenDataset::from_jsonl(file); });
    EXPECT_NE(message.find(file.string() + c.expected), std::string::npos) << c.line << " -> " << message;
  }
  EXPECT_NE(error_of([&] { TokenDataset::from_jsonl(dir / "absent.jsonl"); }).find("absent.jsonl: cannot open"),
            std::string::npos);
  EXPECT_NE(error_of([&] { TokenDataset::from_jsonl(write_file(dir, "empty.jsonl", "\n")); }).find("holds no examples"),
            std::string::npos);
}

TEST(BatchingTest, EpochOrderIsASeededPermutationThatChangesPerEpoch) {
  auto a = epoch_order(50, 7, 0);
  EXPECT_EQ(a, epoch_order(50, 7, 0));
  EXPECT_NE(a, epoch_order(50, 7, 1));
  EXPECT_NE(a, epoch_order(50, 8, 0));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, epoch_order(50, 7, 0, /*shuffle=*/false));
}

TEST(BatchingTest, PaddingRightPadsWithMaskAndIgnoredLabels) {
  auto data = TokenDataset::from_examples({{{1, 2, 3}, {}, 0}, {{4, 5, 6, 7, 8}, {-100, -100, 6, 7, 8}, 0}});
  MicroBatchOptions options;
  options.micro_batch_size = 2;
  auto plans = plan_micro_batches(data, {0, 1}, options);
  ASSERT_EQ(plans.size(), 1u);
  auto mb = collate(data, plans[0], options);
  EXPECT_TRUE(at::equal(mb.input_ids, at::tensor({1, 2, 3, 0, 0, 4, 5, 6, 7, 8}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(mb.attention_mask, at::tensor({1, 1, 1, 0, 0, 1, 1, 1, 1, 1}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(mb.labels, at::tensor({-100, 2, 3, -100, -100, -100, -100, 6, 7, 8}, at::kLong).view({2, 5})));
  EXPECT_EQ(mb.num_tokens, 8);
  EXPECT_EQ(mb.num_targets, 5);
}

TEST(BatchingTest, PackingConcatenatesWithinTheBudgetRestartingPositions) {
  auto data = TokenDataset::from_examples({{{1, 2, 3}, {}, 0}, {{4, 5}, {}, 0}, {{6, 7, 8, 9}, {}, 0}});
  MicroBatchOptions options;
  options.mode = BatchingMode::kPacking;
  options.pack_length = 6;
  options.micro_batch_size = 2;
  auto plans = plan_micro_batches(data, {0, 1, 2}, options);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0], (MicroBatchPlan{{0, 1}, {2}}));
  auto mb = collate(data, plans[0], options);
  EXPECT_TRUE(at::equal(mb.input_ids, at::tensor({1, 2, 3, 4, 5, 6, 7, 8, 9, 0}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(mb.position_ids.narrow(1, 0, 4), at::tensor({0, 1, 2, 0, 0, 1, 2, 3}, at::kLong).view({2, 4})));
  // No target across a boundary: the first token of every example is ignored.
  EXPECT_TRUE(at::equal(mb.labels, at::tensor({-100, 2, 3, -100, 5, -100, 7, 8, 9, -100}, at::kLong).view({2, 5})));
  EXPECT_EQ(mb.num_targets, 6);
}

// ---- schedule ------------------------------------------------------------------------------

TEST(ScheduleTest, LinearWarmupThenCosineToTheMinimum) {
  const double peak = 1e-3;
  EXPECT_DOUBLE_EQ(warmup_cosine_learning_rate(0, 110, 10, peak), 0.0);
  EXPECT_DOUBLE_EQ(warmup_cosine_learning_rate(5, 110, 10, peak), 0.5 * peak);
  EXPECT_DOUBLE_EQ(warmup_cosine_learning_rate(10, 110, 10, peak), peak);
  EXPECT_NEAR(warmup_cosine_learning_rate(60, 110, 10, peak), 0.5 * peak, 1e-15);
  EXPECT_NEAR(warmup_cosine_learning_rate(35, 110, 10, peak), peak * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_NEAR(warmup_cosine_learning_rate(110, 110, 10, peak), 0.0, 1e-18);
  EXPECT_NEAR(warmup_cosine_learning_rate(60, 110, 10, peak, 1e-4), 1e-4 + 0.5 * (peak - 1e-4), 1e-15);
  EXPECT_DOUBLE_EQ(warmup_cosine_learning_rate(0, 10, 0, peak), peak);  // no warm-up: starts at the peak
}

// ---- training ------------------------------------------------------------------------------

LoraConfig test_lora(double dropout = 0.0) {
  LoraConfig lora;
  lora.r = 4;
  lora.target_modules = {"q_proj", "v_proj", "down_proj", "c_attn", "c_fc"};
  lora.init_b_zero = false;  // non-zero gradients everywhere from the first step
  lora.dropout = dropout;
  return lora;
}

struct Tenant {
  CausalLM lm;
  std::vector<at::Tensor> adapter;
};

Tenant make_tenant(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client, const LoraConfig& lora,
                   uint64_t init_seed = 1234) {
  Tenant t;
  t.lm = open_causal_lm(checkpoint, client);
  at::manual_seed(init_seed);
  t.adapter = add_lora(*t.lm.module, lora);
  return t;
}

TrainerOptions quiet_options() {
  TrainerOptions o;
  o.progress = false;
  o.learning_rate = 1e-2;
  return o;
}

TEST(TrainerTest, TwoMicroBatchesAccumulatedEqualOneBatchOfBoth) {
  auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto data = TokenDataset::from_examples(random_examples(4, 11));
  auto accumulated = make_tenant(*checkpoint, nullptr, test_lora());
  auto whole = make_tenant(*checkpoint, nullptr, test_lora());
  auto options = quiet_options();
  options.max_steps = 1;
  options.batching.micro_batch_size = 2;
  options.grad_accum = 2;
  Trainer a(accumulated.lm, accumulated.adapter, data, options);
  options.batching.micro_batch_size = 4;
  options.grad_accum = 1;
  Trainer b(whole.lm, whole.adapter, data, options);
  auto sa = a.step();
  auto sb = b.step();
  EXPECT_EQ(sa.targets, sb.targets);
  EXPECT_LT(std::abs(sa.loss - sb.loss) / std::abs(sb.loss), 1e-5) << sa.loss << " vs " << sb.loss;
  EXPECT_LT(std::abs(sa.grad_norm - sb.grad_norm) / sb.grad_norm, 1e-5);
  for (size_t i = 0; i < accumulated.adapter.size(); ++i) {
    EXPECT_LT(relative_error(accumulated.adapter[i].grad(), whole.adapter[i].grad()), 1e-5) << "tensor " << i;
    EXPECT_LT(relative_error(accumulated.adapter[i], whole.adapter[i]), 1e-5) << "tensor " << i;
  }
}

TEST(TrainerTest, StepLossIsTheMeanOverTrainedPositions) {
  auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto data = TokenDataset::from_examples(random_examples(3, 5));
  auto tenant = make_tenant(*checkpoint, nullptr, test_lora());
  double sum = 0;
  int64_t targets = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    auto ids = at::tensor(data[i].input_ids, at::kLong).unsqueeze(0);
    auto labels = at::tensor(data[i].labels, at::kLong).unsqueeze(0);
    at::NoGradGuard no_grad;
    const int64_t n = labels.narrow(1, 1, labels.size(1) - 1).ne(kIgnoreIndex).sum().item<int64_t>();
    sum += causal_lm_loss(tenant.lm.forward(ids, {}), labels).item<double>() * n;
    targets += n;
  }
  auto options = quiet_options();
  options.batching.micro_batch_size = 2;
  options.grad_accum = 2;
  Trainer trainer(tenant.lm, tenant.adapter, data, options);
  const double eval = trainer.evaluate(data);  // before any step: the same numbers
  EXPECT_LT(std::abs(eval - sum / targets) / (sum / targets), 1e-6);
  auto s = trainer.step();
  EXPECT_EQ(s.targets, targets);
  EXPECT_LT(std::abs(s.loss - sum / targets) / (sum / targets), 1e-5);
  EXPECT_TRUE(trainer.done());  // 3 examples, 2 a micro-batch, 2 micro-batches a step: one step
}

// Training 10 steps equals training 5, checkpointing, and training 5 more in a new trainer with a
// new model and a new connection; with LoRA dropout (random state), warm-up, clipping, shuffling
// over several epochs and a resume in the middle of one.
TEST(TrainerTest, ResumeFromACheckpointIsExactAgainstAnExecutor) {
  auto served = testing::serve_model("tiny-llama");
  const auto& [dir, checkpoint, executor, client] = served;
  auto data = TokenDataset::from_examples(random_examples(7, 3));
  auto options = quiet_options();
  options.max_steps = 10;
  options.warmup_steps = 3;
  options.max_grad_norm = 0.5;
  options.batching.micro_batch_size = 2;  // 4 micro-batches an epoch: step 5 is inside epoch 1
  options.seed = 42;
  const auto lora = test_lora(/*dropout=*/0.1);

  auto full_tenant = make_tenant(*checkpoint, client, lora);
  Trainer full(full_tenant.lm, full_tenant.adapter, data, options);
  at::manual_seed(99);  // the dropout stream
  full.train();
  ASSERT_EQ(full.history().size(), 10u);

  const auto saved = testing::temp_dir("trainer-resume") / "checkpoint-5";
  {
    auto first_tenant = make_tenant(*checkpoint, testing::connect(*executor, *checkpoint), lora);
    Trainer first(first_tenant.lm, first_tenant.adapter, data, options,
                  [&](const fs::path& d) { save_lora(*first_tenant.lm.module, lora, d); });
    at::manual_seed(99);
    first.train(5);
    first.save_checkpoint(saved);
    at::manual_seed(12345);  // whatever happens to the random state after saving does not matter
  }
  EXPECT_TRUE(fs::exists(saved / "adapter" / "adapter_model.safetensors"));
  auto second_tenant = make_tenant(*checkpoint, testing::connect(*executor, *checkpoint), lora, /*init_seed=*/777);
  Trainer second(second_tenant.lm, second_tenant.adapter, data, options);
  second.load_checkpoint(saved);
  EXPECT_EQ(second.steps_done(), 5);
  second.train();
  ASSERT_EQ(second.history().size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(second.history()[i].loss, full.history()[i].loss) << "step " << i + 1;
    EXPECT_EQ(second.history()[i].learning_rate, full.history()[i].learning_rate) << "step " << i + 1;
    EXPECT_EQ(second.history()[i].epoch, full.history()[i].epoch) << "step " << i + 1;
  }
  EXPECT_EQ(full.history().back().epoch, 2);
  for (size_t i = 0; i < full_tenant.adapter.size(); ++i) {
    EXPECT_TRUE(at::equal(second_tenant.adapter[i], full_tenant.adapter[i])) << "tensor " << i;
  }
}

TEST(TrainerTest, ResumeRefusesOtherSettingsNamingTheField) {
  auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto data = TokenDataset::from_examples(random_examples(4, 3));
  auto options = quiet_options();
  auto tenant = make_tenant(*checkpoint, nullptr, test_lora());
  Trainer trainer(tenant.lm, tenant.adapter, data, options);
  trainer.step();
  const auto saved = testing::temp_dir("trainer-refuse") / "ckpt";
  trainer.save_checkpoint(saved);
  options.grad_accum = 2;
  auto other = make_tenant(*checkpoint, nullptr, test_lora());
  Trainer changed(other.lm, other.adapter, data, options);
  auto message = error_of([&] { changed.load_checkpoint(saved); });
  EXPECT_NE(message.find("grad_accum is 1 in the checkpoint but 2 now"), std::string::npos) << message;
  EXPECT_EQ(changed.steps_done(), 0);
  EXPECT_EQ(latest_checkpoint(saved), saved);
  LoraConfig bigger = test_lora();
  bigger.r = 8;
  auto wrong = make_tenant(*checkpoint, nullptr, bigger);
  Trainer wrong_shape(wrong.lm, wrong.adapter, data, quiet_options());
  message = error_of([&] { wrong_shape.load_checkpoint(saved); });
  EXPECT_NE(message.find("has shape"), std::string::npos) << message;
}

TEST(TrainerTest, RefusesTokenIdsOutsideTheVocabularyNamingTheLine) {
  auto checkpoint = Checkpoint::open(testing::make_checkpoint("tiny-llama"));
  auto file =
      write_file(testing::temp_dir("trainer-vocab"), "t.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 300]}\n");
  auto tenant = make_tenant(*checkpoint, nullptr, test_lora());
  auto message = error_of([&] { Trainer(tenant.lm, tenant.adapter, TokenDataset::from_jsonl(file), quiet_options()); });
  EXPECT_NE(message.find("t.jsonl:2: input_ids[1] = 300 is not below the model's vocab_size 256"), std::string::npos)
      << message;
}

// symbiosis-finetune end to end against an in-process executor: trains with evaluation and
// checkpoints, resumes from its save directory, and the adapter it wrote loads into a model.
// The resumed run's final loss equals an uninterrupted monolithic run's.
TEST(FinetuneProgramTest, TrainsResumesAndWritesALoadableAdapter) {
  const auto model = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(model);
  auto executor = testing::start_executor(model);
  const auto dir = testing::temp_dir("finetune");
  std::string train, eval;
  for (const auto& e : random_examples(6, 31)) {
    std::string ids;
    for (auto id : e.input_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    train += "{\"input_ids\": [" + ids + "]}\n";
  }
  for (const auto& e : random_examples(2, 32)) {
    std::string ids;
    for (auto id : e.input_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    eval += "{\"input_ids\": [" + ids + "]}\n";
  }
  const auto train_file = write_file(dir, "train.jsonl", train);
  const auto eval_file = write_file(dir, "eval.jsonl", eval);
  const std::string common = testing::binary("examples/symbiosis-finetune") + " --model " + model.string() +
                             " --train " + train_file.string() + " --eval " + eval_file.string() +
                             " --lora-r 4 --lora-dropout 0.1 --lr 1e-2 --steps 6 --warmup 2 --micro-batch 2"
                             " --grad-accum 1 --save-every 3 --seed 5 --no-progress";
  auto run = [&](const std::string& args, const fs::path& out) {
    const std::string command = common + " " + args + " > " + out.string() + " 2> " + out.string() + ".err";
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    return text;
  };
  auto last_line = [](const std::string& text) {
    auto end = text.find_last_not_of('\n');
    return text.substr(text.rfind('\n', end) + 1, end - text.rfind('\n', end));
  };
  // A full split run of 6 steps saves checkpoint-3 and checkpoint-6. Removing checkpoint-6 and
  // resuming the save directory continues from checkpoint-3, as after an interruption at step 3.
  const auto split_dir = dir / "split";
  const auto full_text =
      run("--executor " + executor->endpoint() + " --save-dir " + split_dir.string(), dir / "full.out");
  EXPECT_NE(full_text.find("step 6 eval_loss"), std::string::npos) << full_text;
  ASSERT_TRUE(fs::exists(split_dir / "checkpoint-3" / "trainer_state.json"));
  ASSERT_TRUE(fs::exists(split_dir / "checkpoint-6" / "adapter" / "adapter_config.json"));
  fs::remove_all(split_dir / "checkpoint-6");
  const auto resumed_text = run(
      "--executor " + executor->endpoint() + " --save-dir " + split_dir.string() + " --resume " + split_dir.string(),
      dir / "resumed.out");
  const auto mono_text = run("--monolithic --save-dir " + (dir / "mono").string(), dir / "mono.out");
  const auto full_last = last_line(full_text);
  const auto resumed_last = last_line(resumed_text);
  EXPECT_EQ(full_last, resumed_last);  // printed with 6 decimals: the same run
  auto loss_of = [](const std::string& line) { return std::stod(line.substr(line.find("loss ") + 5)); };
  const double mono_loss = loss_of(last_line(mono_text));
  EXPECT_LT(std::abs(loss_of(full_last) - mono_loss) / mono_loss, 1e-5) << full_last << " vs " << mono_text;

  auto lm = open_causal_lm(*checkpoint, nullptr);
  auto config = load_lora(*lm.module, split_dir / "checkpoint-6" / "adapter");
  EXPECT_EQ(config.r, 4);
  EXPECT_FALSE(lora_state(*lm.module).empty());
}

// A symbiosis-finetune run in a shell: its exit status, stdout and stderr.
struct ProgramRun {
  int status = 0;
  std::string out, err;
  // "done: step N loss L ..." -> L
  double final_loss() const {
    const auto at = out.rfind("done: step");
    EXPECT_NE(at, std::string::npos) << out << err;
    return at == std::string::npos ? NAN : std::stod(out.substr(out.find("loss ", at) + 5));
  }
};

ProgramRun run_finetune(const std::string& args, const fs::path& dir, const std::string& name) {
  const auto out = dir / (name + ".out"), err = dir / (name + ".err");
  // In `dir`: a run without --save-dir saves under its working folder.
  const std::string command = "cd " + dir.string() + " && " + testing::binary("examples/symbiosis-finetune") + " " +
                              args + " > " + out.string() + " 2> " + err.string();
  ProgramRun run;
  const int status = std::system(command.c_str());
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream o(out), e(err);
  run.out.assign(std::istreambuf_iterator<char>(o), {});
  run.err.assign(std::istreambuf_iterator<char>(e), {});
  return run;
}

std::string ids_jsonl(const std::vector<TokenExample>& examples) {
  std::string text;
  for (const auto& e : examples) {
    std::string ids;
    for (auto id : e.input_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    text += "{\"input_ids\": [" + ids + "]}\n";
  }
  return text;
}

// Every PEFT method of the runtime through symbiosis-finetune: split training ends at the loss of
// monolithic training, and the adapter saved is its method's PEFT file, which loads back.
TEST(FinetuneProgramTest, EveryMethodTrainsSplitAsMonolithicAndSavesItsAdapter) {
  const auto model = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(model);
  auto executor = testing::start_executor(model);
  const auto dir = testing::temp_dir("finetune-methods");
  const auto train = write_file(dir, "train.jsonl", ids_jsonl(random_examples(6, 41)));
  const std::vector<std::pair<std::string, std::string>> methods = {
      {"dora", "LORA"},         {"adalora", "ADALORA"},     {"ia3", "IA3"}, {"prompt", "PROMPT_TUNING"},
      {"p-tuning", "P_TUNING"}, {"prefix", "PREFIX_TUNING"}};
  for (const auto& [method, peft_type] : methods) {
    SCOPED_TRACE(method);
    const std::string common = "--model " + model.string() + " --train " + train.string() + " --method " + method +
                               " --steps 3 --micro-batch 2 --lr 1e-2 --seed 5 --no-progress --virtual-tokens 4"
                               " --adalora-init-r 4 --adalora-target-r 2";
    const auto save = dir / method;
    const auto split = run_finetune(common + " --executor " + executor->endpoint() + " --save-dir " + save.string(),
                                    dir, method + "-split");
    const auto mono = run_finetune(common + " --monolithic", dir, method + "-mono");
    ASSERT_EQ(split.status, 0) << split.err;
    ASSERT_EQ(mono.status, 0) << mono.err;
    EXPECT_LT(std::abs(split.final_loss() - mono.final_loss()) / mono.final_loss(), 1e-5) << split.out << mono.out;
    auto lm = open_causal_lm(*checkpoint, nullptr);
    const auto loaded = load_peft_adapter(*lm.module, save / "checkpoint-3" / "adapter");
    EXPECT_EQ(loaded.peft_type, peft_type);
    EXPECT_FALSE(loaded.parameters.empty());
  }
}

// PEFT's defaults and files: without --lora-targets a model gets PEFT's targets for its type
// (c_attn on GPT-2, where the old default for every model, q_proj,v_proj, matched nothing), an entry
// that names no layer is refused naming it, and the adapter saved records its base as PEFT does, so
// that PEFT's AutoPeftModelForCausalLM loads it with its base, untold.
TEST(FinetuneProgramTest, LoraTargetsDefaultAsPeftsAndTheAdapterNamesItsBase) {
  const auto model = testing::make_checkpoint("tiny-gpt2");
  const auto dir = testing::temp_dir("finetune-peft-defaults");
  const auto train = write_file(dir, "train.jsonl", ids_jsonl(random_examples(4, 47)));
  const std::string common = "--monolithic --model " + model.string() + " --train " + train.string() +
                             " --steps 2 --micro-batch 2 --no-progress";
  const auto save = dir / "run";
  const auto trained = run_finetune(common + " --save-dir " + save.string(), dir, "defaults");
  ASSERT_EQ(trained.status, 0) << trained.err;
  const auto adapter = save / "checkpoint-2" / "adapter";
  std::ifstream in(adapter / "adapter_config.json");
  const auto config = nlohmann::json::parse(in);
  EXPECT_EQ(config["target_modules"], nlohmann::json::array({"c_attn"}));
  EXPECT_EQ(config["base_model_name_or_path"], fs::absolute(model).lexically_normal().string());
  const int loaded = testing::run_reference("peft_auto_load.py", {"--adapter", adapter.string()}, dir / "auto.log");
  if (loaded != 3) EXPECT_EQ(loaded, 0) << "PEFT's AutoPeftModelForCausalLM did not load it: see " << dir / "auto.log";

  const auto bogus = run_finetune(common + " --lora-targets c_attn,bogus", dir, "bogus");
  EXPECT_NE(bogus.status, 0);
  for (const char* part : {"the LoRA target_modules entry (bogus) matched no base layer", "c_attn"}) {
    EXPECT_NE(bogus.err.find(part), std::string::npos) << part << " not in: " << bogus.err;
  }
}

// [Stopping]: a SIGINT to a running symbiosis-finetune ends it after the step in progress with a
// checkpoint (exit status 130, "stopped"), `latest` links to it, --save-total-limit kept only the
// newest two, --adapter-style lookups find its adapter, and --resume goes on from it. A run without
// --save-dir saves too: in a new folder under symbiosis-runs/ of its working folder, named at start.
TEST(FinetuneProgramTest, ASignalSavesACheckpointAndStopsAndEveryRunSaves) {
  const auto model = testing::make_checkpoint("tiny-llama");
  const auto dir = testing::temp_dir("finetune-stop");
  const auto train = write_file(dir, "train.jsonl", ids_jsonl(random_examples(6, 53)));
  const std::string common = "--monolithic --model " + model.string() + " --train " + train.string() +
                             " --micro-batch 2 --lr 1e-2 --min-lr 1e-2 --seed 3 --no-progress";
  const auto save = dir / "run";
  const pid_t pid =
      testing::spawn({"/bin/sh", "-c",
                      "exec " + testing::binary("examples/symbiosis-finetune") + " " + common +
                          " --steps 1000000 --save-every 1 --save-total-limit 2 --save-dir " + save.string() + " > " +
                          (dir / "stop.out").string() + " 2> " + (dir / "stop.err").string()});
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  // Three steps in: checkpoint-3 or a later one (--save-total-limit may have pruned checkpoint-3 already).
  auto three_steps_in = [&] {
    if (!fs::exists(save)) return false;
    const auto found = checkpoints_in(save);
    return !found.empty() && std::stoll(found.back().filename().string().substr(11)) >= 3;
  };
  while (!three_steps_in() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  std::ifstream out_file(dir / "stop.out"), err_file(dir / "stop.err");
  const std::string out(std::istreambuf_iterator<char>(out_file), {}),
      err(std::istreambuf_iterator<char>(err_file), {});
  ASSERT_TRUE(WIFEXITED(status)) << err;
  EXPECT_EQ(WEXITSTATUS(status), 130) << err;
  ASSERT_EQ(out.rfind("stopped: step ", 0), 0u) << out << err;
  const int64_t step = std::stoll(out.substr(std::string("stopped: step ").size()));
  EXPECT_GE(step, 3);
  EXPECT_LT(step, 1000000);
  EXPECT_NE(err.find("stopped by SIGINT at step " + std::to_string(step)), std::string::npos) << err;
  const auto kept = checkpoints_in(save);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept.back().filename(), "checkpoint-" + std::to_string(step));
  EXPECT_EQ(fs::read_symlink(save / "latest"), "checkpoint-" + std::to_string(step));
  EXPECT_EQ(adapter_in(save), kept.back() / "adapter");
  EXPECT_EQ(adapter_in(kept.back()), kept.back() / "adapter");
  auto lm = open_causal_lm(*Checkpoint::open(model), nullptr);
  EXPECT_EQ(load_peft_adapter(*lm.module, adapter_in(save)).peft_type, "LORA");
  const auto resumed =
      run_finetune(common + " --steps " + std::to_string(step + 2) + " --resume " + save.string(), dir, "resumed");
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("done: step " + std::to_string(step + 2)), std::string::npos) << resumed.out;

  // No --save-dir: the run saves in symbiosis-runs/<date>-<time>/ of its working folder, and says so.
  const auto work = dir / "work";
  fs::create_directories(work);
  const int plain = testing::shell("cd " + work.string() + " && " + testing::binary("examples/symbiosis-finetune") +
                                   " " + common + " --steps 2 > plain.out 2> plain.err");
  ASSERT_EQ(plain, 0);
  ASSERT_TRUE(fs::is_directory(work / "symbiosis-runs"));
  const auto run = fs::directory_iterator(work / "symbiosis-runs")->path();
  EXPECT_TRUE(fs::exists(run / "checkpoint-2" / "adapter" / "adapter_config.json"));
  std::ifstream plain_err(work / "plain.err");
  const std::string said(std::istreambuf_iterator<char>(plain_err), {});
  EXPECT_NE(said.find("checkpoints go to symbiosis-runs/" + run.filename().string()), std::string::npos) << said;
}

// [Lost executor] (client_runtime/training/trainer.cpp): the executor goes for good in the middle
// of a run that saves no periodic checkpoint. symbiosis-finetune ends with the error, naming the
// checkpoint of the steps it had done, which holds them, and --resume goes on from it to the loss
// of a whole run as long (monolithic both; the split steps equal monolithic ones within 1e-5).
TEST(FinetuneProgramTest, AnExecutorLostForGoodLeavesACheckpointOfTheStepsDone) {
  const auto model = testing::make_checkpoint("tiny-llama");
  const auto dir = testing::temp_dir("finetune-lost");
  const auto train = write_file(dir, "train.jsonl", ids_jsonl(random_examples(6, 61)));
  const std::string common = " --model " + model.string() + " --train " + train.string() +
                             " --micro-batch 2 --lr 1e-2 --min-lr 1e-2 --seed 5 --no-progress";
  auto executor = testing::start_executor(model);
  const auto save = dir / "run";
  const auto requests = executor->stats().requests;
  const pid_t pid =
      testing::spawn({"/bin/sh", "-c",
                      "exec " + testing::binary("examples/symbiosis-finetune") + common + " --executor " +
                          executor->endpoint() + " --reconnect-ms 500 --steps 1000000 --save-dir " + save.string() +
                          " > " + (dir / "lost.out").string() + " 2> " + (dir / "lost.err").string()});
  // A few steps in (a step of the tiny model is dozens of calls), the executor stops for good.
  EXPECT_TRUE(
      testing::wait_until([&] { return executor->stats().requests > requests + 300; }, std::chrono::seconds(120)));
  executor.reset();
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  std::ifstream err_file(dir / "lost.err");
  const std::string err(std::istreambuf_iterator<char>(err_file), {});
  ASSERT_TRUE(WIFEXITED(status)) << err;
  EXPECT_EQ(WEXITSTATUS(status), 2) << err;
  const std::string said = "failed; the training of the ";
  const auto at = err.find(said);
  ASSERT_NE(at, std::string::npos) << err;
  const int64_t steps = std::stoll(err.substr(at + said.size()));
  EXPECT_GE(steps, 1);
  const auto checkpoint = save / ("checkpoint-" + std::to_string(steps));
  EXPECT_NE(err.find("is saved in " + checkpoint.string()), std::string::npos) << err;
  std::ifstream state_file(checkpoint / "trainer_state.json");
  ASSERT_TRUE(state_file) << err;
  EXPECT_EQ(nlohmann::json::parse(state_file).at("step").get<int64_t>(), steps);
  const std::string length = " --steps " + std::to_string(steps + 2);
  const auto resumed = run_finetune("--monolithic" + common + length + " --resume " + save.string(), dir, "resumed");
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  const auto whole = run_finetune("--monolithic" + common + length, dir, "whole");
  ASSERT_EQ(whole.status, 0) << whole.err;
  auto final_loss = [](const std::string& out) { return std::stod(out.substr(out.find(" loss ") + 6)); };
  EXPECT_NEAR(final_loss(resumed.out), final_loss(whole.out), 1e-4 * std::abs(final_loss(whole.out)))
      << resumed.out << whole.out;
}

// --resume keeps the saved adapter and base model: a method flag that disagrees with the adapter,
// and another base model, are refused naming both values, and a finished run extended with --steps continues where it stopped (with a constant
// learning rate, to the loss of a run as long from the start).
TEST(FinetuneProgramTest, ResumeRefusesChangedAdapterFlagsAndExtendsAFinishedRun) {
  const auto model = testing::make_checkpoint("tiny-llama");
  const auto dir = testing::temp_dir("finetune-resume");
  const auto train = write_file(dir, "train.jsonl", ids_jsonl(random_examples(6, 43)));
  const std::string common = "--monolithic --model " + model.string() + " --train " + train.string() +
                             " --lr 1e-2 --min-lr 1e-2 --micro-batch 2 --seed 7 --no-progress";
  const auto save = dir / "run";
  ASSERT_EQ(run_finetune(common + " --lora-r 4 --steps 3 --save-dir " + save.string(), dir, "first").status, 0);

  const auto changed = run_finetune(common + " --lora-r 8 --steps 3 --resume " + save.string(), dir, "changed");
  EXPECT_EQ(changed.status, 2);
  EXPECT_NE(changed.err.find("--lora-r is 8 but the adapter being resumed"), std::string::npos) << changed.err;
  EXPECT_NE(changed.err.find("has 4"), std::string::npos) << changed.err;
  const auto method = run_finetune(common + " --method ia3 --steps 3 --resume " + save.string(), dir, "method");
  EXPECT_NE(method.err.find("--method is ia3 but the adapter being resumed"), std::string::npos) << method.err;

  // The same shapes with other weights: another base model, refused naming both hashes.
  const auto other = testing::make_checkpoint("tiny-llama", "--seed 99");
  const auto other_model = run_finetune("--monolithic --model " + other.string() + " --train " + train.string() +
                                            " --lr 1e-2 --min-lr 1e-2 --micro-batch 2 --seed 7 --no-progress"
                                            " --steps 3 --resume " +
                                            save.string(),
                                        dir, "other-model");
  EXPECT_EQ(other_model.status, 2);
  EXPECT_NE(other_model.err.find("was trained on base model \"" + Checkpoint::open(model)->model_hash() +
                                 "\" but this model is \"" + Checkpoint::open(other)->model_hash() + "\""),
            std::string::npos)
      << other_model.err;

  const auto extended =
      run_finetune(common + " --steps 5 --save-dir " + save.string() + " --resume " + save.string(), dir, "extended");
  ASSERT_EQ(extended.status, 0) << extended.err;
  EXPECT_NE(extended.out.find("done: step 5"), std::string::npos) << extended.out;
  const auto whole = run_finetune(common + " --lora-r 4 --steps 5", dir, "whole");
  ASSERT_EQ(whole.status, 0) << whole.err;
  EXPECT_DOUBLE_EQ(extended.final_loss(), whole.final_loss());
}

// Text through the tenant tools, with the checkpoint's tokenizer (a SentencePiece model beside a
// tiny Llama): a JSON Lines file of text and of prompt/completion pairs becomes the examples
// [Text examples] describes, symbiosis-finetune trains an adapter on it, and symbiosis-generate
// streams a prompt's reply as text: the same tokens, and text, as its JSON Lines reply for the
// same prompt.
TEST(FinetuneProgramTest, TrainsOnTextAndGeneratesText) {
  std::string why;
  const auto* reference = testing::reference_tokenizers(why);
  if (!reference) GTEST_SKIP() << why;
  const auto dir = testing::temp_dir("finetune-text");
  const auto model =
      testing::with_tokenizer(*reference, "spm_unigram", testing::make_checkpoint("tiny-llama"), dir / "model");
  const auto tokenizer = Tokenizer::from_directory(model);
  ASSERT_LE(tokenizer->vocab_size(), 256);  // within the tiny model's vocabulary

  const auto train = write_file(dir, "train.jsonl",
                                "{\"text\": \"the quick brown fox jumps over the lazy dog\"}\n"
                                "{\"prompt\": \"question: what is 12 plus 30?\", \"completion\": \" answer: 42\"}\n"
                                "{\"text\": \"hello world, hello tokens\"}\n");
  const auto data = TokenDataset::from_jsonl(train, tokenizer.get());
  ASSERT_EQ(data.size(), 3u);
  auto expected_text = tokenizer->encode("the quick brown fox jumps over the lazy dog");
  expected_text.push_back(*tokenizer->eos_token_id());
  EXPECT_EQ(data[0].input_ids, expected_text);
  EXPECT_EQ(data[0].labels, expected_text);
  const auto prompt = tokenizer->encode("question: what is 12 plus 30?");
  auto completion = tokenizer->encode(" answer: 42", /*add_special_tokens=*/false);
  completion.push_back(*tokenizer->eos_token_id());
  ASSERT_EQ(data[1].input_ids.size(), prompt.size() + completion.size());
  for (size_t i = 0; i < data[1].input_ids.size(); ++i) {
    const bool in_prompt = i < prompt.size();
    EXPECT_EQ(data[1].input_ids[i], in_prompt ? prompt[i] : completion[i - prompt.size()]) << i;
    EXPECT_EQ(data[1].labels[i], in_prompt ? kIgnoreIndex : completion[i - prompt.size()]) << i;
  }
  EXPECT_NE(error_of([&] { TokenDataset::from_jsonl(train); }).find("train.jsonl:1: text: a line of text needs"),
            std::string::npos);

  const auto save = dir / "run";
  const auto trained = run_finetune("--monolithic --model " + model.string() + " --train " + train.string() +
                                        " --steps 2 --lr 1e-2 --no-progress --save-dir " + save.string(),
                                    dir, "text");
  ASSERT_EQ(trained.status, 0) << trained.err;
  EXPECT_TRUE(std::isfinite(trained.final_loss()));

  const std::string generate = testing::binary("examples/symbiosis-generate") + " --monolithic --model " +
                               model.string() + " --adapter " + (save / "checkpoint-2" / "adapter").string() +
                               " --max-new-tokens 12";
  const auto streamed_file = dir / "streamed.txt", json_file = dir / "reply.jsonl";
  ASSERT_EQ(std::system((generate + " --prompt 'hello world' > " + streamed_file.string()).c_str()), 0);
  ASSERT_EQ(std::system(("echo '{\"prompt\": \"hello world\"}' | " + generate + " > " + json_file.string()).c_str()),
            0);
  std::ifstream streamed_in(streamed_file), json_in(json_file);
  std::string streamed((std::istreambuf_iterator<char>(streamed_in)), {});
  std::string line;
  std::getline(json_in, line);
  const auto reply = nlohmann::json::parse(line);
  const auto output_ids = reply.at("output_ids").get<std::vector<int64_t>>();
  ASSERT_FALSE(output_ids.empty()) << line;
  EXPECT_EQ(reply.at("prompt_ids").get<std::vector<int64_t>>(), tokenizer->encode("hello world"));
  // The tiny model's vocabulary (256) is larger than the tokenizer's: tokens past it have no text.
  std::vector<int64_t> with_text;
  for (auto id : output_ids) {
    if (id < tokenizer->vocab_size()) with_text.push_back(id);
  }
  EXPECT_EQ(reply.at("text").get<std::string>(), tokenizer->decode(with_text, /*skip_special_tokens=*/true));
  EXPECT_EQ(streamed, reply.at("text").get<std::string>() + "\n");
}

// Split training equals monolithic training over a few trainer steps, for both batching modes.
class SplitTrainerTest : public ::testing::TestWithParam<std::tuple<std::string, BatchingMode>> {};

TEST_P(SplitTrainerTest, LossesAndAdapterEqualMonolithic) {
  const auto& [preset, mode] = GetParam();
  auto served = testing::serve_model(preset);
  const auto& checkpoint = served.checkpoint;
  auto data = TokenDataset::from_examples(random_examples(8, 21));
  auto eval = TokenDataset::from_examples(random_examples(3, 22));
  auto options = quiet_options();
  options.batching.mode = mode;
  options.batching.micro_batch_size = 2;
  options.batching.pack_length = 16;
  options.grad_accum = 2;
  options.max_steps = 3;
  options.warmup_steps = 1;
  auto split = make_tenant(*checkpoint, served.client, test_lora());
  auto mono = make_tenant(*checkpoint, nullptr, test_lora());
  Trainer split_trainer(split.lm, split.adapter, data, options);
  Trainer mono_trainer(mono.lm, mono.adapter, data, options);
  split_trainer.set_eval_data(eval);
  mono_trainer.set_eval_data(eval);
  auto split_stats = split_trainer.train();
  auto mono_stats = mono_trainer.train();
  ASSERT_EQ(split_stats.size(), 3u);
  for (size_t i = 0; i < split_stats.size(); ++i) {
    EXPECT_LT(std::abs(split_stats[i].loss - mono_stats[i].loss) / mono_stats[i].loss, 1e-5) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(split_stats[i].loss));
  }
  ASSERT_TRUE(split_stats.back().eval_loss && mono_stats.back().eval_loss);
  EXPECT_LT(std::abs(*split_stats.back().eval_loss - *mono_stats.back().eval_loss) / *mono_stats.back().eval_loss,
            1e-5);
  for (size_t i = 0; i < split.adapter.size(); ++i) {
    EXPECT_LT(relative_error(split.adapter[i], mono.adapter[i]), 1e-5) << "tensor " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, SplitTrainerTest,
                         ::testing::Combine(::testing::Values("tiny-llama", "tiny-gpt2"),
                                            ::testing::Values(BatchingMode::kPadding, BatchingMode::kPacking)),
                         [](const auto& info) {
                           std::string name =
                               std::get<0>(info.param) +
                               (std::get<1>(info.param) == BatchingMode::kPacking ? "_packing" : "_padding");
                           for (auto& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return name;
                         });

}  // namespace
}  // namespace symbiosis
