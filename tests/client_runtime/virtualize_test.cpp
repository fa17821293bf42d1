// Invariant 4 (model transparency): virtualize() binds the base layers of a module tree that is
// not one of ours (nested modules, ModuleList, Sequential) with no change to its code, and the
// virtualized tree computes what the original computes, forward and backward.
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <fstream>

#include "client_runtime/models/model_io.h"
#include "client_runtime/nn.h"
#include "client_runtime/peft/lora.h"
#include "client_runtime/virtualize.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

using testing::relative_error;

// A tenant's own model, written without knowledge of Symbiosis beyond its layer type.
struct UserMlpImpl : torch::nn::Module {
  explicit UserMlpImpl(int64_t hidden) {
    fc_in = register_module("fc_in", nn::Linear(6, hidden));
    fc_out = register_module("fc_out", nn::Linear(hidden, 6, /*bias=*/false));
  }
  at::Tensor forward(const at::Tensor& x) { return fc_out(at::gelu(fc_in(x))); }
  nn::Linear fc_in{nullptr}, fc_out{nullptr};
};
TORCH_MODULE(UserMlp);

struct UserNetImpl : torch::nn::Module {
  explicit UserNetImpl(int64_t hidden = 10) {
    blocks = register_module("blocks", torch::nn::ModuleList(UserMlp(hidden), UserMlp(hidden)));
    head = register_module("head", torch::nn::Sequential(nn::Linear(6, 6), torch::nn::Tanh(), nn::Linear(6, 3)));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& block : *blocks) x = x + block->as<UserMlpImpl>()->forward(x);
    return head->forward(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Sequential head{nullptr};
};
TORCH_MODULE(UserNet);

// Writes a checkpoint holding the net's weights under their tree names.
std::filesystem::path save_as_checkpoint(const torch::nn::Module& net, const std::string& model_type = "user-net") {
  auto dir = testing::temp_dir(model_type);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : net.named_parameters()) tensors.emplace_back(p.key(), p.value().detach());
  write_safetensors(dir / "model.safetensors", tensors);
  std::ofstream(dir / "config.json") << R"({"model_type": ")" << model_type << R"("})";
  return dir;
}

// The virtualized net computes what the reference computes on x: its output, and the gradient
// that a loss of the output sends back to x.
template <typename Net>
void expect_same_forward_and_backward(Net& split, Net& reference, const at::Tensor& x) {
  auto x_split = x.clone().requires_grad_(true);
  auto x_ref = x.clone().requires_grad_(true);
  auto y_split = split->forward(x_split);
  auto y_ref = reference->forward(x_ref);
  EXPECT_LT(relative_error(y_split, y_ref), 1e-5);
  y_split.pow(2).sum().backward();
  y_ref.pow(2).sum().backward();
  EXPECT_LT(relative_error(x_split.grad(), x_ref.grad()), 1e-5);
}

std::unique_ptr<Executor> serve_everything(const std::filesystem::path& dir) {
  ExecutorOptions options;
  options.layers.pattern = ".*";  // every 2-D weight of this model is a base layer
  return testing::start_executor(dir, options);
}

TEST(VirtualizeTest, UserModuleTreeComputesTheSameForwardAndBackward) {
  at::manual_seed(3);
  UserNet reference;
  auto dir = save_as_checkpoint(*reference);
  auto executor = serve_everything(dir);
  auto client = testing::connect(*executor);
  ASSERT_EQ(client->layers().size(), 6u);

  UserNet split;
  EXPECT_EQ(virtualize(*split, client, {.require_all = true}), 6u);
  for (const auto& p : split->named_parameters()) EXPECT_EQ(p.value().numel(), 0) << p.key() << " kept its weights";

  expect_same_forward_and_backward(split, reference, at::randn({3, 5, 6}));
}

TEST(VirtualizeTest, RefusesALayerWhoseShapeDiffersFromTheExecutors) {
  UserNet wide(12);
  auto executor = serve_everything(save_as_checkpoint(*wide));
  UserNet narrow(10);
  try {
    virtualize(*narrow, testing::connect(*executor));
    FAIL() << "virtualize should have thrown";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("cannot virtualize module 'blocks.0.fc_in'"), std::string::npos) << message;
    EXPECT_NE(message.find("Linear(in=6, out=10, bias=1)"), std::string::npos) << message;
    EXPECT_NE(message.find("Linear(in=6, out=12, bias=1)"), std::string::npos) << message;
  }
}

// A tenant model written purely against LibTorch: torch::nn::Linear members called as fc(x).
struct TorchNetImpl : torch::nn::Module {
  TorchNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 10));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(10, 6).bias(false)));
    head = register_module("head", torch::nn::Sequential(torch::nn::Linear(6, 4), torch::nn::ReLU()));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(x + fc2(at::tanh(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Sequential head{nullptr};
};
TORCH_MODULE(TorchNet);

TEST(VirtualizeTest, PlainTorchLinearModelsAreVirtualizedWithoutChangingTheirCode) {
  at::manual_seed(5);
  TorchNet reference;
  auto executor = serve_everything(save_as_checkpoint(*reference, "torch-net"));
  auto client = testing::connect(*executor);

  TorchNet split;
  EXPECT_EQ(virtualize(*split, client, {.require_all = true}), 3u);
  EXPECT_FALSE(split->fc1->bias.defined());  // the executor adds it
  split->to(at::kCPU);                       // Module::to keeps working on virtual weights

  auto x = at::randn({2, 7, 6});
  expect_same_forward_and_backward(split, reference, x);
  const auto calls_after_training = client->calls();
  EXPECT_EQ(calls_after_training, 6u);  // three layers, forward and backward

  {
    at::NoGradGuard no_grad;
    EXPECT_LT(relative_error(split->forward(x), reference->forward(x)), 1e-5);
  }
  {
    c10::InferenceMode inference;
    EXPECT_LT(relative_error(split->forward(x), reference->forward(x)), 1e-5);
  }
  EXPECT_EQ(client->calls(), calls_after_training + 6u);
}

// Three layers that read one input, under the names an executor groups by default.
struct SiblingsImpl : torch::nn::Module {
  SiblingsImpl() {
    q_proj = register_module("q_proj", nn::Linear(6, 8, /*bias=*/false));
    k_proj = register_module("k_proj", nn::Linear(6, 4, /*bias=*/false));
    v_proj = register_module("v_proj", nn::Linear(6, 4, /*bias=*/false));
  }
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    return nn::forward_siblings({q_proj.get(), k_proj.get(), v_proj.get()}, x);
  }
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
};
TORCH_MODULE(Siblings);

// [Layer groups]: siblings computed as one product of their weights stacked (split: one call of
// the executor's group; monolithic: one GEMM of their weights stacked, of which theirs become
// views) give what each layer's own forward gives, forward and backward, with an adapter on one of
// them; without a group on the executor they go one by one.
TEST(VirtualizeTest, SiblingsComputedAsOneStackedProductEqualEachLayersForward) {
  at::manual_seed(5);
  Siblings reference;
  const auto dir = save_as_checkpoint(*reference);
  Siblings mono, split;
  load_weights(*mono, *Checkpoint::open(dir));
  auto executor = serve_everything(dir);
  auto client = testing::connect(*executor);
  ASSERT_EQ(client->groups().size(), 1u);
  EXPECT_EQ(client->groups()[0].name, "{q_proj,k_proj,v_proj}");
  EXPECT_EQ(client->groups()[0].out_features, 16);
  virtualize(*split, client);
  LoraConfig lora{.r = 2, .target_modules = {"k_proj"}, .init_b_zero = false};
  for (auto* model : {&reference, &mono, &split}) {
    at::manual_seed(6);
    add_lora(**model, lora);
  }
  auto x = at::randn({5, 6});
  auto projection = at::randn({5, 16});
  std::vector<at::Tensor> inputs, grads;
  std::vector<std::vector<at::Tensor>> outputs;
  for (auto* model : {&reference, &mono, &split}) {
    inputs.push_back(x.clone().requires_grad_(true));
    outputs.push_back(model == &reference
                          ? std::vector<at::Tensor>{(*model)->q_proj(inputs.back()), (*model)->k_proj(inputs.back()),
                                                    (*model)->v_proj(inputs.back())}
                          : (*model)->forward(inputs.back()));
    (at::cat(outputs.back(), -1) * projection).sum().backward();
  }
  for (size_t i : {1, 2}) {
    for (size_t layer = 0; layer < 3; ++layer) {
      EXPECT_LT(relative_error(outputs[i][layer], outputs[0][layer]), 1e-6) << "model " << i << ", layer " << layer;
    }
    EXPECT_LT(relative_error(inputs[i].grad(), inputs[0].grad()), 1e-6) << "model " << i;
  }
  EXPECT_EQ(client->calls(), 2u);  // one call of the group forward, one backward
  // Monolithic: the layers' weights are views of one stack (memory stays the same).
  const auto* stack = static_cast<const char*>(mono->q_proj->weight.data_ptr());
  EXPECT_EQ(mono->k_proj->weight.data_ptr(), stack + 8 * 6 * sizeof(float));
  EXPECT_EQ(mono->v_proj->weight.data_ptr(), stack + 12 * 6 * sizeof(float));

  // An executor that serves no groups: the same, one layer at a time.
  ExecutorOptions options;
  options.layers.pattern = ".*";
  options.layers.groups = {};
  auto ungrouped = testing::start_executor(dir, options);
  auto one_by_one = testing::connect(*ungrouped);
  EXPECT_TRUE(one_by_one->groups().empty());
  Siblings alone;
  virtualize(*alone, one_by_one);
  const auto parts = alone->forward(x);
  EXPECT_EQ(one_by_one->calls(), 3u);
  EXPECT_LT(relative_error(parts[0], outputs[0][0]), 1e-6);
}

TEST(VirtualizeTest, RequireAllNamesAServedLayerTheModelLacks) {
  UserNet net;
  auto executor = serve_everything(save_as_checkpoint(*net));
  UserMlp lone(10);  // has fc_in/fc_out, but not under blocks.N
  try {
    virtualize(*lone, testing::connect(*executor), {.require_all = true});
    FAIL() << "virtualize should have thrown";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("but the model has no base layer of that name"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace symbiosis
