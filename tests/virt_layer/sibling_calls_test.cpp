// [Sibling calls]: layers that read one input go to the executor as one group, learned from the
// model's calls. Every result equals what the layer's own call returns, and every gradient is bit
// for bit what it is without groups, whatever the model does after the groups were learned: call a
// sibling with another input, change the input in place, leave a result unused, or stop calling a
// sibling at all.
#include <gtest/gtest.h>

#include "client_runtime/causal_lm.h"
#include "client_runtime/client.h"
#include "tests/test_util.h"
#include "virt_layer/virt_layer.h"

namespace symbiosis {
namespace {

class SiblingCallsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_checkpoint("tiny-llama");
    executor_ = testing::start_executor(dir_);
    client_ = connect(true);
    for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
      const auto* info = client_->find_layer(std::string("model.layers.0.self_attn.") + name);
      ASSERT_NE(info, nullptr) << name;
      layers_.push_back(VirtLayer(*info, client_));
    }
  }

  std::shared_ptr<Client> connect(bool sibling_groups) {
    ClientOptions options;
    options.endpoint = executor_->endpoint();
    options.transport = "shm";
    options.sibling_groups = sibling_groups;
    return Client::connect(options);
  }

  // What layer i computes when called alone (through a client that never groups).
  at::Tensor alone(size_t i, const at::Tensor& x) {
    if (!reference_) reference_ = connect(false);
    at::NoGradGuard no_grad;
    return reference_->forward(layers_[i]->info(), x.reshape({-1, x.size(-1)}), true).reshape(
        {x.size(0), x.size(1), layers_[i]->info().out_features});
  }

  // Calls q, k and v with x, as an attention does; returns the hand-offs it took.
  uint64_t call_all(const at::Tensor& x, std::vector<at::Tensor>* results = nullptr) {
    const auto before = client_->hand_offs();
    std::vector<at::Tensor> ys;
    for (auto& layer : layers_) ys.push_back(layer->forward(x));
    for (size_t i = 0; i < ys.size(); ++i) EXPECT_LT(testing::relative_error(ys[i], alone(i, x)), 1e-6) << i;
    if (results) *results = ys;
    return client_->hand_offs() - before;
  }

  std::filesystem::path dir_;
  std::unique_ptr<Executor> executor_;
  std::shared_ptr<Client> client_, reference_;
  std::vector<VirtLayer> layers_;
};

TEST_F(SiblingCallsTest, LayersCalledWithOneInputBecomeOneHandOff) {
  auto x = at::randn({2, 5, 64});
  EXPECT_EQ(call_all(x), 3u);  // learning
  EXPECT_EQ(call_all(x), 1u);
  EXPECT_EQ(call_all(at::randn({1, 3, 64})), 1u);  // any input, once learned
  EXPECT_EQ(client_->calls(), 9u);
}

TEST_F(SiblingCallsTest, GradientsAreBitForBitThoseOfLayersCalledAlone) {
  call_all(at::randn({2, 5, 64}));
  auto x = at::randn({2, 5, 64}).requires_grad_(true);
  std::vector<at::Tensor> ys;
  ASSERT_EQ(call_all(x, &ys), 1u);
  const auto before = client_->hand_offs();
  (ys[0].square().sum() + ys[1].sum() * 3 + ys[2].cos().sum()).backward();
  EXPECT_EQ(client_->hand_offs() - before, 3u);  // one node per layer, as without groups

  auto x_alone = x.detach().clone().requires_grad_(true);
  auto solo = connect(false);
  std::vector<at::Tensor> solo_ys;
  for (auto& layer : layers_) solo_ys.push_back(VirtLayer(layer->info(), solo)->forward(x_alone));
  (solo_ys[0].square().sum() + solo_ys[1].sum() * 3 + solo_ys[2].cos().sum()).backward();
  for (size_t i = 0; i < ys.size(); ++i) EXPECT_TRUE(at::equal(ys[i], solo_ys[i])) << i;
  EXPECT_TRUE(at::equal(x.grad(), x_alone.grad()));
}

TEST_F(SiblingCallsTest, AnUnusedResultHasNoGradientAndNoCall) {
  call_all(at::randn({2, 5, 64}));
  auto x = at::randn({2, 5, 64}).requires_grad_(true);
  std::vector<at::Tensor> ys;
  ASSERT_EQ(call_all(x, &ys), 1u);
  const auto calls = client_->calls();
  ys[1].sum().backward();  // k alone
  EXPECT_EQ(client_->calls() - calls, 1u);
  auto x_alone = x.detach().clone().requires_grad_(true);
  VirtLayer(layers_[1]->info(), connect(false))->forward(x_alone).sum().backward();
  EXPECT_LT(testing::relative_error(x.grad(), x_alone.grad()), 1e-6);
}

TEST_F(SiblingCallsTest, AnInputChangedInPlaceIsComputedAgain) {
  auto x = at::randn({2, 5, 64});
  call_all(x);
  auto q = layers_[0]->forward(x);  // computes k and v too
  x.add_(1);
  EXPECT_LT(testing::relative_error(layers_[1]->forward(x), alone(1, x)), 1e-6);
  EXPECT_LT(testing::relative_error(layers_[2]->forward(x), alone(2, x)), 1e-6);
}

TEST_F(SiblingCallsTest, SiblingsCalledWithAnotherInputUnlearnTheGroup) {
  auto x = at::randn({2, 5, 64}), other = at::randn({2, 5, 64});
  call_all(x);
  layers_[0]->forward(x);
  EXPECT_LT(testing::relative_error(layers_[1]->forward(other), alone(1, other)), 1e-6);
  EXPECT_LT(testing::relative_error(layers_[2]->forward(other), alone(2, other)), 1e-6);
  // k's and v's results for x were never called for: from now on every layer goes alone.
  EXPECT_EQ(call_all(x), 3u);
  EXPECT_EQ(call_all(x), 3u);
}

TEST_F(SiblingCallsTest, ASiblingNoLongerCalledUnlearnsTheGroup) {
  auto x = at::randn({2, 5, 64});
  call_all(x);
  layers_[0]->forward(x);
  layers_[1]->forward(x);  // v's result waits, never called for
  EXPECT_EQ(call_all(x), 3u);
}

TEST_F(SiblingCallsTest, NoGroupsWhenTheClientAsksForNone) {
  client_ = connect(false);
  for (auto& layer : layers_) layer = VirtLayer(layer->info(), client_);
  auto x = at::randn({2, 5, 64});
  EXPECT_EQ(call_all(x), 3u);
  EXPECT_EQ(call_all(x), 3u);
}

TEST_F(SiblingCallsTest, TcpSendsEveryLayerAlone) {
  ClientOptions options;
  options.endpoint = executor_->endpoint();
  options.transport = "tcp";
  client_ = Client::connect(options);
  for (auto& layer : layers_) layer = VirtLayer(layer->info(), client_);
  auto x = at::randn({2, 5, 64});
  call_all(x);
  EXPECT_EQ(call_all(x), 3u);
}

}  // namespace
}  // namespace symbiosis
