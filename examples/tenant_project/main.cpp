// A tenant's fine-tuning program: virtualize the model, train a LoRA adapter, save it.
// Usage: tenant_finetune EXECUTOR_ENDPOINT CHECKPOINT_DIR ADAPTER_OUT_DIR
#include <symbiosis/client.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>
#include <symbiosis/training.h>
#include <torch/optim/adamw.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " EXECUTOR_ENDPOINT CHECKPOINT_DIR ADAPTER_OUT_DIR\n";
    return 2;
  }
  auto checkpoint = symbiosis::Checkpoint::open(argv[2]);
  auto client = symbiosis::Client::connect(
      {.endpoint = argv[1], .tenant = "tenant-example", .expected_model_hash = checkpoint->model_hash()});
  auto model = symbiosis::open_causal_lm(*checkpoint, client);  // base layers run on the executor

  symbiosis::LoraConfig lora{.r = 8, .alpha = 16, .target_modules = {"q_proj", "v_proj"}};
  auto params = symbiosis::add_lora(*model.module, lora);
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-2));

  auto ids = at::randint(0, 256, {2, 32}, at::kLong);
  double first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    optimizer.zero_grad();
    auto loss = symbiosis::causal_lm_loss(model.forward(ids, {}), ids);
    loss.backward();
    model.settle();  // every base-layer call answered: see Client::settle
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  symbiosis::save_lora(*model.module, lora, argv[3]);
  std::cout << "loss " << first << " -> " << last << ", adapter saved to " << argv[3] << std::endl;
  return last < first ? 0 : 1;
}
