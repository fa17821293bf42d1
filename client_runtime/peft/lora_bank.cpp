// [Multi-adapter batches]: reading adapters for a bank, the bank, and its layers.
#include "client_runtime/peft/lora_bank.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <typeinfo>

#include "client_runtime/peft/files.h"
#include "client_runtime/peft/model_adapter.h"
#include "client_runtime/peft/prompt.h"

#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/multi_lora.h"
static_assert(symbiosis::kMaxBankLoraRank == symbiosis::kernels::kMultiLoraMaxRank);
#endif

namespace symbiosis {

BankModel bank_model(torch::nn::Module& model, at::ScalarType dtype) {
  BankModel shape;
  if (auto* host = dynamic_cast<ModelAdapterHost*>(&model)) shape.model_type = host->model_shape().model_type;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    if (base == nullptr) continue;
    shape.layers.push_back({item.key(), base->in_features(), base->out_features()});
    const auto& adapter = base->adapter();
    if (!adapter || !shape.refusal.empty()) continue;
    const auto& lora = *adapter;
    if (typeid(lora) != typeid(LoraAdapterImpl)) {
      shape.refusal = "its layer " + item.key() + " carries an adapter of another kind than plain LoRA (" +
                      std::string(typeid(lora).name()) + ": IA3, DoRA, AdaLoRA... apply to every row)";
    } else if (static_cast<const LoraAdapterImpl&>(lora).lora_A.scalar_type() != dtype) {
      shape.refusal = "its own LoRA adapter is in " +
                      std::string(c10::toString(static_cast<const LoraAdapterImpl&>(lora).lora_A.scalar_type())) +
                      ", not the model's " + c10::toString(dtype);
    }
  }
  if (shape.refusal.empty() && prompt_learning_adapter(model)) {
    shape.refusal = "it carries a prompt-learning adapter (virtual tokens for every sequence)";
  }
  return shape;
}

namespace {

// read_banked_lora and banked_lora: `json` (checked by peft::check_config) and `tensors` are the
// adapter's two files, read from `dir` or handed over in memory.
BankedLora banked_lora_of(const BankModel& model, const nlohmann::json& json,
                          const std::map<std::string, at::Tensor>& tensors, const std::filesystem::path& dir,
                          int64_t max_rank) {
  const auto config_file = dir / "adapter_config.json";
  std::string type;
  if (json.contains("peft_type")) {
    type = json["peft_type"].is_string() ? json["peft_type"].get<std::string>() : json["peft_type"].dump();
  }
  TORCH_CHECK(type == "LORA", config_file, ": field 'peft_type' is '", type,
              "'; a multi-adapter generator serves LORA adapters only");
  BankedLora lora;
  lora.dir = dir;
  lora.config = parse_lora_config(json, dir);
  TORCH_CHECK(!lora.config.use_dora, config_file,
              ": field 'use_dora' is true; a multi-adapter generator serves plain LoRA (DoRA's magnitude needs the"
              " base weights' norms per layer)");
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& layer : model.layers) {
    if (!lora_targets(layer.path, lora.config)) continue;
    const int64_t rank = lora.config.rank_for(layer.path);
    const double alpha = lora.config.alpha_for(layer.path);
    TORCH_CHECK(rank <= max_rank, config_file, ": layer ", layer.path, " has rank ", rank,
                ", more than the generator's max_lora_rank (", max_rank, ")");
    BankedLora::Layer l;
    l.path = layer.path;
    l.a = at::empty({rank, layer.in_features});
    l.b = at::empty({layer.out_features, rank});
    l.scaling = lora_scaling(alpha, rank, lora.config.use_rslora);
    state.emplace_back(peft::kKeyPrefix + l.path + ".lora_A.weight", l.a);
    state.emplace_back(peft::kKeyPrefix + l.path + ".lora_B.weight", l.b);
    lora.layers.push_back(std::move(l));
  }
  if (lora.layers.empty()) {
    std::vector<std::string> paths;
    for (const auto& layer : model.layers) paths.push_back(layer.path);
    TORCH_CHECK(false, "LoRA adapter ", dir, peft::adapter_origin(json), ": ",
                peft::no_layer_matched(model.model_type, paths, "its target_modules", lora.config.target_modules),
                ". Was the adapter made for another model?");
  }
  peft::load_state(tensors, json, dir, state, "LoRA");  // names and shapes, naming what differs
  return lora;
}

}  // namespace

BankedLora read_banked_lora(const BankModel& model, const std::filesystem::path& dir, int64_t max_rank) {
  const auto config = peft::read_config(dir);  // its refusals before the tensors' file is read
  return banked_lora_of(model, config, peft::read_tensors(dir), dir, max_rank);
}

BankedLora banked_lora(const BankModel& model, const AdapterContents& adapter, int64_t max_rank) {
  const auto json = nlohmann::json::parse(adapter.config_json, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!json.is_discarded(), "bad JSON in ", adapter.dir / "adapter_config.json", " (in memory)");
  peft::check_config(json, adapter.dir, "");
  return banked_lora_of(model, json, adapter.tensors, adapter.dir, max_rank);
}

// A base layer of the bank: the base for every row, then each row's adapter.
class LoraBank::Layer : public LayerAdapterImpl {
 public:
  Layer(std::shared_ptr<LayerAdapterImpl> own, std::shared_ptr<LoraRows> rows, int64_t slots, int64_t max_rank,
        const at::TensorOptions& options)
      : own(std::move(own)), rows_(std::move(rows)), entries_(static_cast<size_t>(slots)), max_rank_(max_rank) {
#ifdef SYMBIOSIS_WITH_CUDA
    if (options.device().is_cuda()) {
      table_ = at::zeros({kernels::multi_lora_table_bytes(slots)}, options.dtype(at::kByte));
    }
#else
    (void)options;
#endif
    if (this->own) {
      const auto& lora = static_cast<const LoraAdapterImpl&>(*this->own);
      set(kOwnSlot, lora.lora_A, lora.lora_B, lora.scaling);
    }
  }

  // Fills (a defined) or empties a slot of this layer.
  void set(int32_t slot, const at::Tensor& a, const at::Tensor& b, double scaling) {
    auto& e = entries_.at(static_cast<size_t>(slot));
    if (e.a.defined() != a.defined()) filled_ += a.defined() ? 1 : -1;
    e = {a, b, scaling};
#ifdef SYMBIOSIS_WITH_CUDA
    if (table_.defined()) {
      std::vector<kernels::MultiLoraEntry> table;
      for (const auto& entry : entries_) table.push_back({entry.a, entry.b, entry.scaling});
      table_.copy_(kernels::multi_lora_table(table));
    }
#endif
  }
  int64_t filled() const { return filled_; }

  at::Tensor forward(const at::Tensor& x, const BaseFn& base) override {
    const auto& rows = *rows_;
    // Outside the generator's steps (a tenant training its own adapter between them): the layer
    // as it was.
    if (!rows.slots.defined()) return own ? own->forward(x, base) : base(x);
    auto y = base(x);
    if (filled_ == 0) return y;
    const int64_t in = x.size(-1), out = y.size(-1), n = x.numel() / in;
    TORCH_CHECK(rows.slots.size(0) == n, "[Multi-adapter batches]: a layer saw ", n,
                " rows but the generator named slots for ", rows.slots.size(0));
    const auto x2 = x.reshape({n, in});
#ifdef SYMBIOSIS_WITH_CUDA
    if (x.is_cuda()) {
      auto y2 = y.reshape({n, out});
      if (y2.stride(1) != 1) y2 = y2.contiguous();
      return kernels::multi_lora(y2, x2.contiguous(), rows.slots, table_, max_rank_).view(y.sizes());
    }
#endif
    TORCH_CHECK(static_cast<int64_t>(rows.host.size()) == n, "[Multi-adapter batches]: a step on ", x.device(),
                " needs its rows' slots on the host");
    // The plain loop: each run of rows of one adapter, as LoraAdapterImpl::forward computes them.
    auto result = y.reshape({n, out}).clone(at::MemoryFormat::Contiguous);
    for (int64_t start = 0; start < n;) {
      const int32_t slot = rows.host[start];
      int64_t end = start + 1;
      while (end < n && rows.host[end] == slot) ++end;
      if (slot >= 0 && slot < static_cast<int32_t>(entries_.size()) && entries_[slot].a.defined()) {
        const auto& e = entries_[slot];
        auto part = result.narrow(0, start, end - start);
        const auto h = at::mm(x2.narrow(0, start, end - start), e.a.t());
        at::add_out(part, part, at::mm(h, e.b.t()), e.scaling);
      }
      start = end;
    }
    return result.view(y.sizes());
  }

  std::shared_ptr<LayerAdapterImpl> own;  // the layer's adapter before the bank, in kOwnSlot

 private:
  struct Entry {
    at::Tensor a, b;
    double scaling = 1.0;
  };
  std::shared_ptr<LoraRows> rows_;
  std::vector<Entry> entries_;  // by slot
  int64_t filled_ = 0;
  int64_t max_rank_;
  at::Tensor table_;  // on a GPU: the entries as the kernel reads them
};

LoraBank::LoraBank(torch::nn::Module& model, const BankModel& shape, int64_t max_loras, int64_t max_rank,
                   at::TensorOptions options)
    : model_(model),
      used_(static_cast<size_t>(max_loras) + 1, false),
      max_rank_(max_rank),
      options_(options),
      rows_(std::make_shared<LoraRows>()) {
  TORCH_CHECK(shape.refusal.empty(), "this generator's model cannot serve several adapters: ", shape.refusal);
  std::vector<std::string> own_layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    if (base == nullptr) continue;
    base_layers_[item.key()] = base;
    if (auto own = std::dynamic_pointer_cast<LoraAdapterImpl>(base->adapter())) {
      max_rank_ = std::max(max_rank_, own->lora_A.size(0));
      own_layers.push_back(item.key());
    }
  }
  TORCH_CHECK(max_rank_ <= kMaxBankLoraRank, "this generator's model's own LoRA has rank ", max_rank_, ", more than ",
              kMaxBankLoraRank, " (the widest a multi-adapter batch takes)");
  has_own_ = !own_layers.empty();
  used_[kOwnSlot] = true;
  for (const auto& path : own_layers) wrap(path);
}

LoraBank::~LoraBank() {
  for (auto& [path, layer] : wrapped_) {
    auto* base = base_layers_.at(path);
    base->take_adapter();
    if (layer->own) base->set_adapter(layer->own);
  }
}

std::shared_ptr<LoraBank::Layer> LoraBank::wrap(const std::string& path) {
  auto& layer = wrapped_[path];
  if (!layer) {
    auto* base = base_layers_.at(path);
    layer =
        std::make_shared<Layer>(base->take_adapter(), rows_, static_cast<int64_t>(used_.size()), max_rank_, options_);
    base->set_adapter(layer);
    layers_changed_ = true;
  }
  return layer;
}

int32_t LoraBank::add(const BankedLora& lora) {
  const auto free = std::find(used_.begin(), used_.end(), false);
  TORCH_CHECK(free != used_.end(), "LoraBank: every slot (", used_.size() - 1, ") holds an adapter");
  const auto slot = static_cast<int32_t>(free - used_.begin());
  at::NoGradGuard no_grad;
  auto& paths = slot_layers_[slot];
  for (const auto& l : lora.layers) {
    wrap(l.path)->set(slot, l.a.to(options_).contiguous(), l.b.to(options_).contiguous(), l.scaling);
    paths.push_back(l.path);
  }
  *free = true;
  return slot;
}

void LoraBank::remove(int32_t slot) {
  TORCH_CHECK(slot != kOwnSlot && slot > 0 && slot < static_cast<int32_t>(used_.size()) && used_[slot],
              "LoraBank: slot ", slot, " holds no adapter");
  for (const auto& path : slot_layers_[slot]) {
    auto& layer = wrapped_.at(path);
    layer->set(slot, at::Tensor(), at::Tensor(), 1.0);
    if (layer->filled() > 0) continue;
    // No adapter (and no own one) left here: the layer computes its base alone again.
    base_layers_.at(path)->take_adapter();
    wrapped_.erase(path);
    layers_changed_ = true;
  }
  slot_layers_.erase(slot);
  used_[slot] = false;
}

int64_t LoraBank::used() const { return std::count(used_.begin() + 1, used_.end(), true); }

bool LoraBank::take_layers_changed() { return std::exchange(layers_changed_, false); }

}  // namespace symbiosis
