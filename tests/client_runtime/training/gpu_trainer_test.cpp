// The tenant trainer on a GPU ([Training on a GPU] in client_runtime/training/trainer.h): captured
// steps (fixed-shape micro-batches, the loss, clipping and FusedAdamW in CUDA graphs) give the
// losses of eager steps, split as monolithic, for a layer-level method, a model-level one and
// AdaLoRA (whose hooks run around the graphs); and symbiosis-finetune on a GPU trains a tiny model
// split and monolithic to the same losses.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "base_executor/executor.h"
#include "bench/process.h"
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/adalora.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/peft/prompt.h"
#include "client_runtime/training/trainer.h"
#include "tests/gpu_test_util.h"
#include "transport/client_transport.h"

namespace symbiosis {
namespace {

namespace fs = std::filesystem;

// Seven examples of 3 to 12 tokens: with two rows a micro-batch and two micro-batches a step, each
// epoch ends on a step of one micro-batch of one row (padding rows and a padding micro-batch when
// captured).
TokenDataset examples() {
  at::manual_seed(61);
  std::vector<TokenExample> out;
  for (int i = 0; i < 7; ++i) {
    const int64_t n = at::randint(3, 13, {1}).item<int64_t>();
    auto ids = at::randint(0, 256, {n}, at::kLong);
    TokenExample e;
    e.input_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
    out.push_back(std::move(e));
  }
  return TokenDataset::from_examples(std::move(out));
}

struct Method {
  std::string name;
  std::function<std::vector<at::Tensor>(torch::nn::Module&)> add;
  bool adalora = false;
};

AdaLoraConfig adalora_config() {
  AdaLoraConfig config;
  config.init_r = 4;
  config.target_r = 2;
  config.total_step = 4;
  config.target_modules = {"q_proj", "v_proj"};
  return config;
}

// The losses of four trainer steps on cuda:0, split through `client` or monolithic.
std::vector<double> train_losses(const Checkpoint& checkpoint, const std::shared_ptr<Client>& client,
                                 const Method& method, bool capture) {
  auto lm = open_causal_lm(checkpoint, client, {at::kFloat, at::Device("cuda:0")});
  at::manual_seed(5);
  auto parameters = method.add(*lm.module);
  TrainerOptions options;
  options.batching.micro_batch_size = 2;
  options.grad_accum = 2;
  options.max_steps = 4;
  options.learning_rate = 1e-2;
  options.shuffle = false;
  options.progress = false;
  options.capture = capture;
  Trainer trainer(lm, parameters, examples(), options);
  std::shared_ptr<AdaLoraAllocator> allocator;
  if (method.adalora) {
    allocator = std::make_shared<AdaLoraAllocator>(*lm.module, adalora_config());
    auto module = lm.module;
    trainer.set_hooks({.extra_loss = [module] { return adalora_orthogonal_regularization(*module, adalora_config()); },
                       .after_update = [allocator](int64_t step) { allocator->update_and_allocate(step); }});
  }
  std::vector<double> losses;
  for (const auto& step : trainer.train()) losses.push_back(step.loss);
  return losses;
}

TEST(GpuTrainerTest, CapturedStepsGiveTheLossesOfEagerStepsSplitAndMonolithic) {
  SKIP_WITHOUT_GPUS(1);
  const auto model = testing::make_checkpoint("tiny-llama");
  auto checkpoint = Checkpoint::open(model);
  // An executor process of its own: CUDA IPC does not open memory of the process that made it.
  const auto executor = bench::start_executor(
      {"--model", model.string(), "--listen", "tcp://127.0.0.1:*", "--device", "cuda:0", "--log-level", "warn"},
      testing::temp_dir("gpu-trainer-executor"));
  struct Stop {
    int pid;
    ~Stop() { bench::stop(pid); }
  } stop{executor.pid};
  auto client = Client::connect(
      {.endpoint = executor.endpoint, .expected_model_hash = checkpoint->model_hash(), .device = "cuda:0"});
  EXPECT_EQ(client->transport(), "cuda-ipc");
  LoraConfig lora;
  lora.r = 4;
  lora.init_b_zero = false;
  const std::vector<Method> methods = {
      {"lora", [lora](torch::nn::Module& m) { return add_lora(m, lora); }},
      {"prefix", [](torch::nn::Module& m) { return add_prefix_tuning(m, {.num_virtual_tokens = 3}); }},
      {"adalora", [](torch::nn::Module& m) { return add_adalora(m, adalora_config()); }, /*adalora=*/true}};
  for (const auto& method : methods) {
    SCOPED_TRACE(method.name);
    const auto eager = train_losses(*checkpoint, nullptr, method, /*capture=*/false);
    const auto captured_mono = train_losses(*checkpoint, nullptr, method, /*capture=*/true);
    const auto captured_split = train_losses(*checkpoint, client, method, /*capture=*/true);
    ASSERT_EQ(eager.size(), 4u);
    ASSERT_EQ(captured_mono.size(), 4u);
    ASSERT_EQ(captured_split.size(), 4u);
    for (size_t i = 0; i < eager.size(); ++i) {
      EXPECT_TRUE(std::isfinite(eager[i])) << i;
      EXPECT_NEAR(captured_mono[i], eager[i], 1e-4 * std::abs(eager[i])) << "step " << i;
      EXPECT_NEAR(captured_split[i], captured_mono[i], 1e-4 * std::abs(eager[i])) << "step " << i;
    }
  }
}

// The training set of examples() as symbiosis-finetune reads it, in `dir`.
fs::path write_train(const fs::path& dir) {
  const auto train = dir / "train.jsonl";
  std::ofstream out(train);
  const auto data = examples();
  for (size_t i = 0; i < data.size(); ++i) {
    std::string ids;
    for (auto id : data[i].input_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    out << "{\"input_ids\": [" << ids << "]}\n";
  }
  return train;
}

// symbiosis-finetune on cuda:0 and an executor on the same GPU in this process (the program's
// client is another process: CUDA IPC), on a tiny Llama with examples() as its training set; the
// programs' output in `dir`.
struct GpuFinetune {
  explicit GpuFinetune(const std::string& name, ExecutorOptions options = {})
      : dir(testing::temp_dir(name)), train(write_train(dir)) {
    options.device = "cuda:0";
    executor = testing::start_executor(model, options);
  }
  // The loss after 6 steps with `args` (its output in dir/RUN.out).
  double loss(const std::string& args, const std::string& run) const {
    const auto out = dir / (run + ".out");
    const std::string command = testing::binary("examples/symbiosis-finetune") + " --model " + model.string() +
                                " --train " + train.string() +
                                " --device cuda:0 --lora-r 4 --lr 1e-2 --steps 6 --micro-batch 2 --grad-accum 2"
                                " --seed 3 --no-progress " +
                                args + " > " + out.string() + " 2> " + out.string() + ".err";
    EXPECT_EQ(testing::shell(command), 0) << command;
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    const auto at = text.rfind("done: step 6 loss ");
    EXPECT_NE(at, std::string::npos) << text;
    return at == std::string::npos ? NAN : std::stod(text.substr(at + 18));
  }
  double split_loss(const std::string& run) const { return loss("--executor " + executor->endpoint(), run); }

  const fs::path model = testing::make_checkpoint("tiny-llama");
  const fs::path dir, train;
  std::unique_ptr<Executor> executor;
};

// The test: symbiosis-finetune on cuda:0, split (the executor on the same GPU) and
// monolithic, trains to the same losses; its eager steps (--no-capture) agree too.
TEST(GpuTrainerTest, FinetuneProgramOnAGpuTrainsSplitToTheMonolithicLosses) {
  SKIP_WITHOUT_GPUS(1);
  const GpuFinetune finetune("gpu-finetune");
  const double split = finetune.split_loss("split");
  const double mono = finetune.loss("--monolithic", "mono");
  const double eager = finetune.loss("--monolithic --no-capture", "eager");
  EXPECT_NEAR(split, mono, 1e-4 * mono);
  EXPECT_NEAR(eager, mono, 1e-4 * mono);
}

// Fine-tuning beside a tenant decoding on the same executor (the executor started with `options`)
// trains to the monolithic losses as alone, and its calls yielded to the decode calls.
void finetune_beside_decode(const std::string& name, const ExecutorOptions& options) {
  const GpuFinetune finetune(name, options);
  const auto& dir = finetune.dir;
  const auto endpoint = finetune.executor->endpoint();
  // The decoding tenant: many requests of 200 new tokens, stopped once the fine-tuning is done.
  const auto requests = dir / "requests.jsonl";
  {
    std::ofstream out(requests);
    for (int r = 0; r < 2048; ++r) out << "{\"prompt_ids\": [" << 1 + r % 200 << ", 7, 9], \"max_new_tokens\": 200}\n";
  }
  const std::string generate = testing::binary("examples/symbiosis-generate") + " --model " + finetune.model.string() +
                               " --executor " + endpoint +
                               " --device cuda:0 --max-sequences 8 --max-tokens 208 --input " + requests.string() +
                               " > " + (dir / "generate.jsonl").string() + " 2> " + (dir / "generate.log").string();
  const auto pid_file = dir / "generate.pid";
  ASSERT_EQ(testing::shell(generate + " & echo $! > " + pid_file.string() + "; sleep 3"), 0);
  const double beside = finetune.split_loss("beside");
  const auto stats = request_stats(endpoint, 10000);
  testing::shell("kill $(cat " + pid_file.string() + ")");
  const double mono = finetune.loss("--monolithic", "mono");
  EXPECT_NEAR(beside, mono, 1e-4 * mono);
  EXPECT_EQ(stats.errors(), 0u);
  EXPECT_GT(stats.yielding_calls(), 0u) << "decode calls: none seen beside the fine-tuning? see " << dir;
}

// [Fine-tuning's SMs] (kernels/direct_gemm.h): the fine-tuning tenant's GEMMs sized for part of the
// GPU (--finetune-sm-percent, half by default).
TEST(GpuTrainerTest, FinetuneBesideADecodingTenantTrainsToTheMonolithicLosses) {
  SKIP_WITHOUT_GPUS(1);
  finetune_beside_decode("gpu-finetune-beside-decode", {});
}

// [Fine-tuning in pieces] (base_executor/batch_runner.h): its calls computed as GEMMs of 16 rows at
// most, at the decode calls' priority.
TEST(GpuTrainerTest, FinetuneInPiecesBesideADecodingTenantTrainsToTheMonolithicLosses) {
  SKIP_WITHOUT_GPUS(1);
  ExecutorOptions options;
  options.finetune_piece_rows = 16;
  finetune_beside_decode("gpu-finetune-pieces-beside-decode", options);
}

}  // namespace
}  // namespace symbiosis
