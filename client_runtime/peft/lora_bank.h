#pragma once
// [Multi-adapter batches]
// Many LoRA adapters in one forward: each row of a base layer's input (a token of a packed
// prefill, a sequence of a decode step) takes the adapter of its sequence, or none. The base is
// computed once for every row (on the executor when split: one call per layer for the whole
// batch); then each adapted layer adds, row by row, x·Aᵀ·Bᵀ·scaling of that row's adapter:
//  - on a GPU, by the [Multi-LoRA kernel] (kernels/multi_lora.h), two launches per layer for every
//    adapter at once, reading the rows' slots and the layer's table of adapters from device memory,
//    so that a decode step captured in a CUDA graph serves whatever adapters its rows name at each
//    replay;
//  - on a CPU, by a plain loop over the runs of rows of one adapter (the same products as
//    LoraAdapterImpl::forward, on those rows).
// LoraBank holds the adapters in numbered slots (at most max_loras, of rank at most max_lora_rank:
// vLLM's names), each layer's in the model's dtype on its device, and wraps the base layers that
// some adapter targets with a layer of the bank (LoraBank::Layer in lora_bank.cpp) until none does.
// A model's own LoRA (what a Generator built with one adapter serves to requests that name none)
// sits in slot kOwnSlot, read from the adapter's own tensors at each step; a layer the own adapter
// targets is wrapped as long as the bank exists, so that rows of other adapters do not get it.
// Outside the generator's steps (LoraRows::slots undefined) a wrapped layer computes as it did
// before, its own adapter included, so a tenant may go on training that adapter between steps. An
// own adapter of another kind (IA3, DoRA, prompt learning...) or of another dtype than the model
// cannot be told apart by row and is refused. Adapters apply without dropout (inference). The
// Generator (inference/generator.h) loads, slots and unloads them at step boundaries and says which
// slot each row takes (LoraRows).
#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "client_runtime/peft/lora.h"

namespace symbiosis {

constexpr int64_t kMaxBankLoraRank = 512;  // the [Multi-LoRA kernel]'s widest rank

// A base layer of a model as an adapter must fit it: its module path and widths.
struct BaseLayerShape {
  std::string path;
  int64_t in_features = 0;
  int64_t out_features = 0;
};

// What a bank needs to know of a model to check adapters for it, taken once (by the thread that
// owns the model), so that adapters can be read and checked on any thread.
struct BankModel {
  std::string model_type;              // "llama", "gpt2", ... ("" when the model does not say)
  std::vector<BaseLayerShape> layers;  // every base layer, in module order
  // Why the model cannot take a bank ("" when it can): an own adapter that is not plain LoRA in the
  // model's dtype.
  std::string refusal;
};
BankModel bank_model(torch::nn::Module& model, at::ScalarType dtype);

// A LoRA adapter read from its PEFT files (adapter_config.json + adapter_model.safetensors) for a
// model, on the host in the file's dtype: per targeted base layer, A [r, in], B [out, r] and the
// scaling (alpha/r, or alpha/sqrt(r) with rsLoRA; after rank_pattern and alpha_pattern).
struct BankedLora {
  struct Layer {
    std::string path;
    at::Tensor a;
    at::Tensor b;
    double scaling = 1.0;
  };
  std::filesystem::path dir;
  LoraConfig config;
  std::vector<Layer> layers;  // in module order
};

// A PEFT adapter's two files' contents: read from its folder, or handed over in memory by the
// trainer that just saved them (symbiosis-tinker's sampler weights), `dir` then the folder they
// were written to, which messages name.
struct AdapterContents {
  std::filesystem::path dir;
  std::string config_json;                    // adapter_config.json
  std::map<std::string, at::Tensor> tensors;  // adapter_model.safetensors' tensors, on the host
};

// Reads and checks the adapter in `dir` for `model`. Refused, naming the folder and what differs:
// a peft_type other than LORA (naming it), DoRA, the LoRA fields read_lora_config refuses, a
// layer's rank above max_rank, target_modules that name no base layer of the model, tensors whose
// names or shapes are not the model's layers' (an adapter of another base model).
BankedLora read_banked_lora(const BankModel& model, const std::filesystem::path& dir, int64_t max_rank);
// The same from contents in memory, checked as the files would be.
BankedLora banked_lora(const BankModel& model, const AdapterContents& adapter, int64_t max_rank);

// The slot each row of the model's current forward takes (-1: none, the base alone), set by the
// generator before each forward of its steps and cleared after them (undefined slots: not a step):
// on the model's device, and on the host unless the step is captured in a CUDA graph (which reads
// slots from device memory only).
struct LoraRows {
  at::Tensor slots;           // [rows] int32
  std::vector<int32_t> host;  // the same, or empty
};

class LoraBank {
 public:
  static constexpr int32_t kOwnSlot = 0;

  // A bank of `max_loras` slots (1, 2, ...) of rank at most max_rank for `model`, whose adapters
  // live in `options`' dtype on its device; wraps the layers of the model's own LoRA, if it has one
  // (shape.refusal must be empty).
  LoraBank(torch::nn::Module& model, const BankModel& shape, int64_t max_loras, int64_t max_rank,
           at::TensorOptions options);
  ~LoraBank();  // every layer gets its own adapter back, or none
  LoraBank(const LoraBank&) = delete;
  LoraBank& operator=(const LoraBank&) = delete;

  bool has_own() const { return has_own_; }
  // Copies `lora` into a free slot (there must be one) and returns the slot.
  int32_t add(const BankedLora& lora);
  void remove(int32_t slot);
  int64_t used() const;  // slots holding an adapter (the own one aside)
  // Whether layers were wrapped or unwrapped since the last call: a step captured before no longer
  // computes what the model does.
  bool take_layers_changed();
  LoraRows& rows() { return *rows_; }

 private:
  class Layer;
  std::shared_ptr<Layer> wrap(const std::string& path);
  torch::nn::Module& model_;
  std::map<std::string, nn::BaseLayerImpl*> base_layers_;    // by path
  std::map<std::string, std::shared_ptr<Layer>> wrapped_;    // by path
  std::vector<bool> used_;                                   // by slot
  std::map<int32_t, std::vector<std::string>> slot_layers_;  // the wrapped layers each slot fills
  int64_t max_rank_;
  at::TensorOptions options_;
  std::shared_ptr<LoraRows> rows_;
  bool has_own_ = false;
  bool layers_changed_ = false;
};

}  // namespace symbiosis
