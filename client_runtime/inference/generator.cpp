#include "client_runtime/inference/generator.h"

#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <set>
#include <string>

#include "client_runtime/client.h"
#include "client_runtime/peft/prompt.h"
#include "client_runtime/training/step_graph.h"
#include "virt_layer/virt_layer.h"

namespace symbiosis {

const char* to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

void GeneratorOptions::validate() const {
  TORCH_CHECK(max_sequences >= 1, "max_sequences is ", max_sequences, ", expected at least 1");
  TORCH_CHECK(max_tokens >= 2, "max_tokens is ", max_tokens, ", expected at least 2 (a prompt token and a new one)");
  TORCH_CHECK(max_waiting >= 1, "max_waiting is ", max_waiting, ", expected at least 1");
  TORCH_CHECK(max_prefill_tokens >= 1, "max_prefill_tokens is ", max_prefill_tokens, ", expected at least 1");
  TORCH_CHECK(capture_warmup >= 1, "capture_warmup is ", capture_warmup, ", expected at least 1");
  TORCH_CHECK(max_loras >= 0, "max_loras is ", max_loras, ", expected at least 0 (0: no load_adapter)");
  TORCH_CHECK(max_lora_rank >= 1 && max_lora_rank <= kMaxBankLoraRank, "max_lora_rank is ", max_lora_rank,
              ", expected 1 to ", kMaxBankLoraRank);
  TORCH_CHECK(host_cache_capacity_bytes >= 0, "host_cache_capacity_bytes is ", host_cache_capacity_bytes,
              ", expected at least 0 (0: no limit)");
}

// [Multi-adapter batches]: a loaded adapter; requests hold it until they end, so that its slot
// outlives its name.
struct Generator::NamedLora {
  std::string name;
  BankedLora lora;
  int32_t slot = -1;  // in bank_, from the step boundary after load_adapter
  std::atomic<bool> unloaded{false};
};

struct Generator::Submitted {
  uint64_t id;
  GenerationRequest request;
  TokenCallback on_token;
  std::shared_ptr<NamedLora> lora;  // null: the model's own adapter or none
};

// One bucket's decode step, captured ([Captured decode]).
struct Generator::DecodeGraph {
  at::Tensor inputs;  // [3, bucket] int64 on the device: token ids, cache slots, starts
  at::Tensor logits;  // [B, vocab]: what the last run wrote
  std::unique_ptr<StepGraph> graph;
  int runs = 0;
};

struct Generator::Sequence {
  explicit Sequence(Submitted submitted)
      : id(submitted.id),
        callback(std::move(submitted.on_token)),
        stop_after(std::move(submitted.request.stop_after)),
        params(submitted.request.sampling),
        sampler(params),
        lora(std::move(submitted.lora)) {
    result.prompt_ids = std::move(submitted.request.prompt_ids);
  }
  uint64_t id;
  TokenCallback callback;
  std::function<bool(int64_t)> stop_after;
  SamplingParams params;
  TokenSampler sampler;
  std::shared_ptr<NamedLora> lora;
  GenerationResult result;
  int64_t slot = -1;
  int64_t cached = 0;       // positions the slot holds
  int64_t next_token = -1;  // produced, not yet fed back
  bool done = false;
};

namespace {

// Sets the client's latency class for one step and puts back the one it had.
class LatencyScope {
 public:
  LatencyScope(const std::shared_ptr<Client>& client, LatencyClass latency) : client_(client.get()) {
    if (client_ == nullptr) return;
    previous_ = client_->latency_class();
    client_->set_latency_class(latency);
  }
  ~LatencyScope() {
    if (client_ != nullptr) client_->set_latency_class(previous_);
  }
  LatencyScope(const LatencyScope&) = delete;
  LatencyScope& operator=(const LatencyScope&) = delete;

 private:
  Client* client_;
  LatencyClass previous_ = LatencyClass::kFineTuning;
};

std::shared_ptr<ModelAdapterImpl> model_adapter_of(torch::nn::Module& module) {
  auto* host = dynamic_cast<ModelAdapterHost*>(&module);
  return host ? host->model_adapter() : nullptr;
}

// [Passive OpenMP]
// A host-decode step alternates the CPU's parallel work (the attention, the client's products) with
// calls to the executor, one at a time. OpenMP's idle threads spin a while after each parallel
// region (libgomp's default), on every core, and the call's own thread and the executor's then
// wait for a core: on a 16-core H100 host the 128 calls of a Llama-2-7B step took 100 ms where
// they take 28 with the threads asleep (LC3 and LC4 in docs/benchmarks-history.md). OpenMP reads
// its wait policy once, when the process starts, so the library can only say so.
void warn_of_spinning_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    std::string value = policy ? policy : "";
    std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::toupper(c); });
    if (value == "PASSIVE") return;
    spdlog::warn(
        "host decode: OMP_WAIT_POLICY is {}: idle OpenMP threads spin after each parallel region and delay "
        "every executor call (about 0.5 ms each on a 16-core host); start the process with "
        "OMP_WAIT_POLICY=PASSIVE",
        policy ? policy : "not set");
  });
}

}  // namespace

Generator::Generator(CausalLM lm, GeneratorOptions options)
    : Generator(std::move(lm), std::nullopt, std::move(options)) {}

Generator::Generator(CausalLM prefill, CausalLM host_decode, GeneratorOptions options)
    : Generator(std::move(prefill), std::optional<CausalLM>(std::move(host_decode)), std::move(options)) {}

Generator::Generator(CausalLM lm, std::optional<CausalLM> host_decode, GeneratorOptions options)
    : lm_(std::move(lm)),
      model_(cached_model(*lm_.module)),
      host_decode_(std::move(host_decode)),
      options_(std::move(options)) {
  options_.validate();
  const auto& table = model_.token_embeddings();
  vocab_size_ = table.size(0);
  const auto shape = model_adapter_host(*lm_.module).model_shape();
  if (host_decode_) {
    // [Host decode]: the CPU copy must compute what the prefill model computes.
    host_decode_model_ = &cached_model(*host_decode_->module);
    const auto& cpu_table = host_decode_model_->token_embeddings();
    TORCH_CHECK(cpu_table.device().is_cpu(), "the host-decode model is on ", cpu_table.device(), ", expected the CPU");
    TORCH_CHECK(cpu_table.sizes() == table.sizes() && cpu_table.scalar_type() == table.scalar_type(),
                "the host-decode model's token embeddings are ", cpu_table.sizes(), " ", cpu_table.scalar_type(),
                ", but the prefill model's are ", table.sizes(), " ", table.scalar_type(),
                ": open both from one checkpoint in one dtype");
    const auto cpu_shape = model_adapter_host(*host_decode_->module).model_shape();
    TORCH_CHECK(cpu_shape.model_type == shape.model_type && cpu_shape.num_layers == shape.num_layers &&
                    cpu_shape.num_key_value_heads == shape.num_key_value_heads && cpu_shape.head_dim == shape.head_dim,
                "the host-decode model is a ", cpu_shape.model_type, " of ", cpu_shape.num_layers,
                " layers, but the prefill model is a ", shape.model_type, " of ", shape.num_layers, " layers");
    TORCH_CHECK(
        !(host_decode_->client && lm_.client && host_decode_->client == lm_.client),
        "the host-decode model shares the prefill model's client; give it a client of its own (device \"cpu\")");
    TORCH_CHECK(!options_.offload_cache,
                "offload_cache and a host-decode model are two placements of the cache: choose one");
    adapter_mirror_ = std::make_unique<AdapterMirror>(*lm_.module, *host_decode_->module);
    warn_of_spinning_threads();
  }
  if (options_.decode_halves) connect_half_client();
  capture_ = options_.capture_decode && !host_decode_ && !options_.offload_cache && table.device().is_cuda();
  // [Host decode] and [Offloaded decode]: the cache in host memory, page-locked for a GPU to write to
  // (and, offloaded, to read from).
  const bool in_host_memory = host_decode_.has_value() || options_.offload_cache;
  const auto cache_device = in_host_memory ? at::Device(at::kCPU) : table.device();
  const bool pinned = in_host_memory && table.device().is_cuda();
  const auto decode_device = options_.offload_cache ? std::optional<at::Device>(table.device()) : std::nullopt;
  // A captured decode step pads its batch to its bucket with rows that write to a spare slot. A
  // generator of one sequence has one bucket, never padded, so no spare slot: it would double the
  // cache of a single long request (64 GiB of GPU memory instead of 32 for 64K tokens of a 7B model).
  const int64_t spare = capture_ && options_.max_sequences > 1 ? 1 : 0;
  if (cache_device.is_cpu() && options_.host_cache_capacity_bytes > 0) {
    const auto per_position = KvCache::bytes_per_position(shape, table.scalar_type());
    const auto needed = per_position * (options_.max_sequences + spare) * options_.max_tokens;
    TORCH_CHECK(needed <= options_.host_cache_capacity_bytes, "the KV cache of max_sequences (", options_.max_sequences,
                ") x max_tokens (", options_.max_tokens, ") positions needs ", needed, " bytes (", per_position,
                " a position), more than host_cache_capacity_bytes (", options_.host_cache_capacity_bytes, ")");
  }
  cache_ = std::make_unique<KvCache>(shape, options_.max_sequences, options_.max_tokens, table.scalar_type(),
                                     cache_device, spare, pinned, decode_device);
  bank_model_ = std::make_unique<BankModel>(bank_model(*lm_.module, table.scalar_type()));
}

void Generator::connect_half_client() {
  TORCH_CHECK(lm_.client,
              "decode_halves: the model is monolithic; its halves would have no calls to overlap "
              "(decode_halves is for a split model, one opened with a client)");
  TORCH_CHECK(!host_decode_ && !options_.offload_cache, "decode_halves and ",
              host_decode_ ? "a host-decode model" : "offload_cache",
              " do not go together: the halves decode where the model's layers are, from a cache there");
  auto options = lm_.client->options();
  options.tenant += "/half2";
  options.latency_class = LatencyClass::kInferenceDecode;  // it only decodes
  options.lane = 1;  // its runs never launch together with the first half's ([Runs launched together])
  half_client_ = Client::connect(options);
  // A VirtLayer redirected to it calls by the layer ids of lm_.client's table ([Decode halves]).
  TORCH_CHECK(half_client_->same_layer_table(*lm_.client), "decode_halves: the executor at ", options.endpoint,
              " gave the second connection another layer table than the first (did it restart with another model?)");
}

Generator::~Generator() = default;

int64_t Generator::virtual_tokens() const {
  const auto adapter = prompt_learning_adapter(*lm_.module);
  return adapter ? adapter->num_virtual_tokens() : 0;
}

uint64_t Generator::submit(GenerationRequest request, TokenCallback on_token) {
  const auto& ids = request.prompt_ids;
  TORCH_CHECK(!ids.empty(), "prompt_ids is empty, expected at least one token id");
  for (size_t i = 0; i < ids.size(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab_size_, "prompt_ids[", i, "] is ", ids[i], ", expected a token id in [0, ",
                vocab_size_, ")");
  }
  request.sampling.validate(vocab_size_);
  const int64_t prompt = static_cast<int64_t>(ids.size()), virtual_length = virtual_tokens();
  const int64_t positions = virtual_length + prompt + request.sampling.max_new_tokens;
  if (cache_->keys(0).device().is_cpu() && options_.host_cache_capacity_bytes > 0) {
    const auto per_position =
        KvCache::bytes_per_position(model_adapter_host(*lm_.module).model_shape(), cache_->keys(0).scalar_type());
    TORCH_CHECK(positions * per_position <= options_.host_cache_capacity_bytes, "prompt_ids (", prompt,
                " tokens) + max_new_tokens (", request.sampling.max_new_tokens, ") + virtual tokens (", virtual_length,
                ") need a KV cache of ", positions * per_position, " bytes (", positions, " positions x ", per_position,
                " bytes), more than host_cache_capacity_bytes (", options_.host_cache_capacity_bytes, ")");
  }
  TORCH_CHECK(positions <= options_.max_tokens, "prompt_ids (", prompt, " tokens) + max_new_tokens (",
              request.sampling.max_new_tokens, ")", virtual_length ? " + the adapter's virtual tokens (" : "",
              virtual_length ? std::to_string(virtual_length) + ")" : "", " need ", positions,
              " cache positions, more than the generator holds per request (max_tokens = ", options_.max_tokens, ")");
  if (const auto limit = model_.max_positions()) {
    TORCH_CHECK(positions <= *limit, "prompt_ids (", prompt, " tokens) + max_new_tokens (",
                request.sampling.max_new_tokens, ") + virtual tokens (", virtual_length, ") reach position ",
                positions - 1, ", beyond the model's n_positions (", *limit, ")");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<NamedLora> lora;
  if (!request.adapter.empty()) {
    const auto named = named_loras_.find(request.adapter);
    TORCH_CHECK(named != named_loras_.end(), "adapter is '", request.adapter,
                "', which is not loaded; loaded adapters: ", adapter_names());
    lora = named->second;
  }
  TORCH_CHECK(queued_ < options_.max_waiting, "the generator is full: ", queued_,
              " requests wait for a cache slot (max_waiting = ", options_.max_waiting,
              "); submit again when some have finished");
  ++queued_;
  const uint64_t id = next_id_++;
  incoming_.push_back(
      std::make_unique<Submitted>(Submitted{id, std::move(request), std::move(on_token), std::move(lora)}));
  return id;
}

std::string Generator::adapter_names() const {
  std::string names;
  for (const auto& [name, lora] : named_loras_) names += (names.empty() ? "" : ", ") + name;
  return names.empty() ? "none" : names;
}

void Generator::load_adapter(const std::string& name, const std::filesystem::path& peft_dir) {
  add_adapter(name, [&] { return read_banked_lora(*bank_model_, peft_dir, options_.max_lora_rank); });
}

void Generator::load_adapter(const std::string& name, const AdapterContents& adapter) {
  add_adapter(name, [&] { return banked_lora(*bank_model_, adapter, options_.max_lora_rank); });
}

void Generator::add_adapter(const std::string& name, const std::function<BankedLora()>& read) {
  TORCH_CHECK(!name.empty(), "load_adapter: the name is empty (requests naming no adapter get the model's own)");
  TORCH_CHECK(!host_decode_, "load_adapter: a [Host decode] generator serves its model's own adapter only");
  TORCH_CHECK(options_.max_loras > 0, "load_adapter: max_loras is 0; set GeneratorOptions::max_loras to hold adapters");
  TORCH_CHECK(bank_model_->refusal.empty(),
              "load_adapter: this generator's model cannot serve several adapters: ", bank_model_->refusal);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!named_loras_.count(name), "load_adapter: an adapter named '", name,
                "' is loaded already; unload it first");
  }
  auto named = std::make_shared<NamedLora>();
  named->name = name;
  try {
    named->lora = read();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "load_adapter '", name, "': ", e.what_without_backtrace());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!named_loras_.count(name), "load_adapter: an adapter named '", name,
              "' is loaded already; unload it first");
  const auto held = static_cast<int64_t>(named_loras_.size()) + unloaded_holding_;
  TORCH_CHECK(held < options_.max_loras, "load_adapter '", name, "': the generator holds max_loras (",
              options_.max_loras, ") adapters already (", named_loras_.size(), " loaded: ", adapter_names(),
              unloaded_holding_ ? "; " + std::to_string(unloaded_holding_) + " unloaded, finishing their requests" : "",
              "); unload one first");
  named_loras_[name] = named;
  loras_to_slot_.push_back(std::move(named));
}

void Generator::unload_adapter(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto named = named_loras_.find(name);
  TORCH_CHECK(named != named_loras_.end(), "unload_adapter: '", name,
              "' is not loaded; loaded adapters: ", adapter_names());
  named->second->unloaded = true;
  ++unloaded_holding_;
  named_loras_.erase(named);
}

std::vector<std::string> Generator::adapters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, lora] : named_loras_) names.push_back(name);
  return names;
}

void Generator::update_bank() {
  std::vector<std::shared_ptr<NamedLora>> joining;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    joining.swap(loras_to_slot_);
  }
  bool changed = false;
  // Unloaded adapters that no request holds any more (nothing else can take them now: their names
  // are gone) leave their slots; those unloaded before they had one never take one.
  int64_t freed = 0;
  for (auto& named : slotted_) {
    if (!named->unloaded || named.use_count() > 1) continue;
    bank_->remove(named->slot);
    named.reset();
    ++freed;
  }
  std::erase_if(slotted_, [](const auto& named) { return !named; });
  for (auto& named : joining) {
    if (named->unloaded && named.use_count() == 1) {
      ++freed;
      continue;
    }
    if (!bank_) {
      const auto where = model_.token_embeddings().options();
      bank_ = std::make_unique<LoraBank>(*lm_.module, *bank_model_, options_.max_loras, options_.max_lora_rank, where);
      changed = true;
    }
    named->slot = bank_->add(named->lora);
    named->lora.layers.clear();  // in the bank now
    slotted_.push_back(std::move(named));
  }
  if (freed > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    unloaded_holding_ -= freed;
  }
  if (bank_ && slotted_.empty()) {
    bank_.reset();  // the model's layers as they were
    changed = true;
  }
  if (bank_ && bank_->take_layers_changed()) changed = true;
  // The captured steps computed the layers as they were: capture again.
  if (changed) decode_graphs_.clear();
}

void Generator::set_bank_rows(const std::vector<StepSequence>& layout, bool last_only) {
  if (!bank_) return;
  auto& rows = bank_->rows();
  rows.host.clear();
  for (size_t i = 0; i < layout.size(); ++i) {
    rows.host.insert(rows.host.end(), last_only ? 1 : layout[i].length, step_slots_.at(i));
  }
  rows.slots = at::tensor(rows.host, at::kInt).to(model_.token_embeddings().device());
}

void Generator::cancel(uint64_t request) {
  std::lock_guard<std::mutex> lock(mutex_);
  cancelled_.insert(request);
}

int64_t Generator::running() const { return static_cast<int64_t>(running_.size()); }
int64_t Generator::captured_batch_sizes() const {
  std::set<int64_t> buckets;
  for (const auto& [key, g] : decode_graphs_) {
    if (g->graph->captured()) buckets.insert(key.first);
  }
  return static_cast<int64_t>(buckets.size());
}
const KvCache& Generator::cache() const { return *cache_; }

void Generator::finish(Sequence& sequence, FinishReason reason, const std::string& error) {
  sequence.done = true;
  sequence.result.finish_reason = reason;
  sequence.result.error = error;
  if (sequence.slot >= 0) cache_->release(sequence.slot);
  sequence.slot = -1;
  if (sequence.callback && (reason == FinishReason::kCancelled || reason == FinishReason::kError)) {
    TokenEvent event;
    event.request = sequence.id;
    event.finished = reason;
    event.error = error;
    sequence.callback(event);
  }
}

void Generator::take_incoming() {
  std::unordered_set<uint64_t> cancelled;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!incoming_.empty()) {
      waiting_.push_back(std::make_unique<Sequence>(std::move(*incoming_.front())));
      incoming_.pop_front();
    }
    cancelled.swap(cancelled_);
  }
  if (!cancelled.empty()) {
    for (auto& s : running_) {
      if (cancelled.count(s->id)) finish(*s, FinishReason::kCancelled);
    }
    for (auto& s : waiting_) {
      if (cancelled.count(s->id)) finish(*s, FinishReason::kCancelled);
    }
    std::erase_if(running_, [](const auto& s) { return s->done; });
    const auto left = std::erase_if(waiting_, [](const auto& s) { return s->done; });
    std::lock_guard<std::mutex> lock(mutex_);
    queued_ -= static_cast<int64_t>(left);
  }
}

bool Generator::step() {
  take_incoming();
  update_bank();
  at::NoGradGuard no_grad;
  // [Host decode]: the CPU copy decodes with the adapter as it is now.
  if (adapter_mirror_) adapter_mirror_->refresh();
  std::vector<Sequence*> joining;
  int64_t prefill_tokens = 0;
  while (!waiting_.empty() && cache_->free_slots() > 0) {
    const auto length = static_cast<int64_t>(waiting_.front()->result.prompt_ids.size());
    if (!joining.empty() && prefill_tokens + length > options_.max_prefill_tokens) break;
    auto sequence = std::move(waiting_.front());
    waiting_.pop_front();
    sequence->slot = *cache_->acquire();
    prefill_tokens += length;
    joining.push_back(sequence.get());
    running_.push_back(std::move(sequence));
  }
  if (!joining.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    queued_ -= static_cast<int64_t>(joining.size());
  }
  const bool decoding = std::any_of(running_.begin(), running_.end(), [&](const auto& s) {
    return std::find(joining.begin(), joining.end(), s.get()) == joining.end();
  });
  if (!joining.empty()) prefill(joining);
  if (decoding || !joining.empty()) decode();
  if (bank_) bank_->rows() = {};  // the model's forward outside the steps is the model's own
  std::erase_if(running_, [](const auto& s) { return s->done; });
  return decoding || !joining.empty();
}

void Generator::run() {
  while (true) {
    if (step()) continue;
    std::lock_guard<std::mutex> lock(mutex_);
    if (incoming_.empty() && cancelled_.empty() && waiting_.empty() && running_.empty()) return;
  }
}

std::vector<GenerationResult> Generator::generate(const std::vector<GenerationRequest>& requests) {
  std::vector<GenerationResult> results(requests.size());
  std::vector<uint64_t> ids;
  try {
    for (size_t i = 0; i < requests.size(); ++i) {
      auto& result = results[i];
      result.prompt_ids = requests[i].prompt_ids;
      ids.push_back(submit(requests[i], [&result](const TokenEvent& event) {
        if (event.token >= 0) {
          result.output_ids.push_back(event.token);
          result.logprobs.push_back(event.logprob);
        }
        if (event.finished) {
          result.finish_reason = *event.finished;
          result.error = event.error;
        }
      }));
    }
  } catch (...) {
    // A refused request refuses the batch: the ones submitted before it leave now, while the
    // results their callbacks write to still exist.
    for (const uint64_t id : ids) cancel(id);
    run();
    throw;
  }
  run();
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!requests[i].sampling.logprobs) results[i].logprobs.clear();
  }
  return results;
}

void Generator::prefill(const std::vector<Sequence*>& sequences) {
  // The adapter as it is now (a tenant may have trained it since the last step).
  const auto adapter = model_adapter_of(*lm_.module);
  const at::Tensor prompts = adapter ? adapter->prompt_embeddings() : at::Tensor();
  const std::vector<PastKeyValue> past = adapter ? adapter->past_key_values() : std::vector<PastKeyValue>();
  const int64_t past_length = past.empty() ? 0 : past[0].key.size(-2);
  std::vector<StepSequence> layout;
  std::vector<at::Tensor> embeddings;
  const auto device = model_.token_embeddings().device();
  for (auto* s : sequences) {
    if (!past.empty()) cache_->write_prefix(s->slot, past);
    auto tokens = model_.embed(at::tensor(s->result.prompt_ids, at::kLong).to(device));
    if (prompts.defined()) tokens = at::cat({prompts.to(tokens.device(), tokens.scalar_type()), tokens}, 0);
    s->cached = past_length;
    layout.push_back({s->slot, past_length, tokens.size(0)});
    embeddings.push_back(tokens);
  }
  const auto packed = at::cat(embeddings, 0).unsqueeze(0);
  set_step_slots(sequences);
  forward_and_choose(lm_, sequences, layout, LatencyClass::kInferencePrefill,
                     [&] { return forward_eager(lm_, model_, layout, packed); });
}

int32_t Generator::bank_slot(const Sequence& sequence) const {
  if (sequence.lora) return sequence.lora->slot;
  return bank_ && bank_->has_own() ? LoraBank::kOwnSlot : -1;
}

void Generator::set_step_slots(const std::vector<Sequence*>& sequences) {
  step_slots_.clear();
  if (!bank_) return;
  for (const auto* s : sequences) step_slots_.push_back(bank_slot(*s));
}

void Generator::decode() {
  std::vector<Sequence*> sequences;
  std::vector<StepSequence> layout;
  std::vector<int64_t> tokens;
  for (auto& s : running_) {
    if (!s->done && s->next_token >= 0) sequences.push_back(s.get());
  }
  if (sequences.empty()) return;
  if (bank_) {
    // [Multi-adapter batches]: one adapter's sequences side by side, so that the CPU's plain loop
    // runs once per adapter, not once per sequence.
    std::stable_sort(sequences.begin(), sequences.end(),
                     [this](const Sequence* a, const Sequence* b) { return bank_slot(*a) < bank_slot(*b); });
  }
  for (const auto* s : sequences) {
    layout.push_back({s->slot, s->cached, 1});
    tokens.push_back(s->next_token);
  }
  auto& model = decode_model();
  // [CPU decode threads] (models/attention.h): a split model's CPU decode step at one LibTorch thread
  // but for its attention and lm_head. (A monolithic model computes its base layers here: those need
  // every thread.)
  const bool on_cpu = model.token_embeddings().device().is_cpu() && !options_.offload_cache;
  const detail::StepThreads threads(on_cpu && decode_lm().client != nullptr);
  // [Decode halves]: the first ceil(B / 2) sequences, and the rest.
  std::vector<DecodePart> parts;
  const size_t first_half = half_client_ && sequences.size() > 1 ? (sequences.size() + 1) / 2 : sequences.size();
  for (size_t i = 0; i < sequences.size(); ++i) {
    if (i == 0 || i == first_half) parts.push_back({.half = i == 0 ? 0 : 1});
    parts.back().sequences.push_back(sequences[i]);
    parts.back().layout.push_back(layout[i]);
    parts.back().tokens.push_back(tokens[i]);
  }
  forward_and_choose(decode_lm(), sequences, layout, LatencyClass::kInferenceDecode, [&] {
    if (capture_) {
      if (auto logits = decode_captured(parts)) return *logits;
    }
    return decode_eager(parts);
  });
}

at::Tensor Generator::decode_eager(const std::vector<DecodePart>& parts) {
  auto& model = decode_model();
  std::vector<at::Tensor> logits;
  for (const auto& part : parts) {
    set_step_slots(part.sequences);
    const BackendRedirect redirect(lm_.client.get(), part.half == 1 ? half_client_.get() : nullptr);
    const auto ids = at::tensor(part.tokens, at::kLong).to(model.token_embeddings().device());
    logits.push_back(forward_eager(decode_lm(), model, part.layout, model.embed(ids).unsqueeze(0)));
    if (part.half == 1) half_client_->settle();
  }
  return logits.size() == 1 ? logits[0] : at::cat(logits);
}

at::Tensor Generator::forward_eager(const CausalLM& lm, CachedModel& model, const std::vector<StepSequence>& layout,
                                    const at::Tensor& embeddings) {
  const CachedStep step(*cache_, layout, embeddings.device());
  set_bank_rows(layout, /*last_only=*/false);
  const auto hidden = model.forward_cached(embeddings, step);
  set_bank_rows(layout, /*last_only=*/true);
  // Logits only where a token is chosen: each sequence's last position (the lm_head, on the
  // executor when split, sees one row a sequence).
  at::Tensor logits;
  {
    const detail::WideThreads wide;  // [CPU decode threads]: the lm_head reads the vocabulary's weights
    logits = model.logits(hidden.index_select(1, step.last_tokens()))[0];
  }
  lm.settle();
  return logits;
}

int64_t Generator::decode_bucket(int64_t sequences) const {
  int64_t bucket = 1;
  while (bucket < sequences) bucket *= 2;
  return std::min(bucket, options_.max_sequences);
}

Generator::DecodeGraph& Generator::decode_graph(int half, int64_t bucket) {
  auto& slot = decode_graphs_[{bucket, half}];
  if (slot) return *slot;
  slot = std::make_unique<DecodeGraph>();
  auto* g = slot.get();
  // Token ids, cache slots, starts and, with a bank, the rows' adapter slots ([Multi-adapter batches]).
  g->inputs = at::zeros({bank_ ? 4 : 3, bucket}, at::TensorOptions().dtype(at::kLong).device(cache_->keys(0).device()));
  const auto& client = half == 1 ? half_client_ : lm_.client;
  g->graph = std::make_unique<StepGraph>(
      [this, g, half] {
        const BackendRedirect redirect(lm_.client.get(), half == 1 ? half_client_.get() : nullptr);
        if (bank_) {
          bank_->rows().slots = g->inputs[3].to(at::kInt);
          bank_->rows().host.clear();
        }
        const auto step = CachedStep::fixed_decode(*cache_, g->inputs[1], g->inputs[2]);
        const auto hidden = model_.forward_cached(model_.embed(g->inputs[0]).unsqueeze(0), step);
        g->logits = model_.logits(hidden)[0];  // every token is its sequence's last
      },
      std::function<void()>(), client, g->inputs.device(), StepGraphOptions{.warmup = options_.capture_warmup});
  return *g;
}

void Generator::set_decode_inputs(DecodeGraph& g, const DecodePart& part) const {
  // Token ids, slots and starts; padding rows: token 0 into the spare slot at position 0.
  const auto count = g.inputs.size(1);
  const auto padding = static_cast<size_t>(count - static_cast<int64_t>(part.layout.size()));
  std::vector<int64_t> inputs(part.tokens);
  inputs.insert(inputs.end(), padding, 0);
  for (const auto& s : part.layout) inputs.push_back(s.slot);
  if (padding > 0) inputs.insert(inputs.end(), padding, cache_->spare_slot());
  for (const auto& s : part.layout) inputs.push_back(s.start);
  inputs.insert(inputs.end(), padding, 0);
  if (bank_) {
    inputs.insert(inputs.end(), step_slots_.begin(), step_slots_.end());
    inputs.insert(inputs.end(), padding, -1);
  }
  g.inputs.copy_(at::tensor(inputs, at::kLong).view({g.inputs.size(0), count}));
}

std::optional<at::Tensor> Generator::decode_captured(const std::vector<DecodePart>& parts) {
  std::vector<DecodeGraph*> graphs;
  bool capturing = false;
  for (const auto& part : parts) {
    graphs.push_back(&decode_graph(part.half, decode_bucket(static_cast<int64_t>(part.layout.size()))));
    capturing = capturing || graphs.back()->runs == options_.capture_warmup;
  }
  // Both halves launched before either is waited for ([Decode halves]); a step that captures runs
  // them one after the other, so that a failed capture leaves nothing in flight.
  std::exception_ptr first_error;
  const auto finish = [&](DecodeGraph& g) {
    try {
      g.graph->finish();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  };
  size_t launched = 0;  // graphs launched and not finished, from the first (none while capturing)
  const auto finish_launched = [&] {
    for (size_t j = 0; j < launched; ++j) finish(*graphs[j]);
  };
  for (size_t i = 0; i < parts.size(); ++i) {
    auto& g = *graphs[i];
    set_step_slots(parts[i].sequences);
    set_decode_inputs(g, parts[i]);
    const bool captures_now = g.runs++ == options_.capture_warmup;
    try {
      g.graph->launch();
    } catch (const ResultsLost&) {
      finish_launched();
      throw;  // [Executor restart]: the step runs again (forward_and_choose), and captures then
    } catch (const c10::Error& e) {
      finish_launched();
      if (!captures_now || g.graph->captured()) throw;
      // This model or transport cannot be captured: decode eagerly from now on.
      TORCH_WARN("Generator: decoding without CUDA graphs: ", e.what_without_backtrace());
      capture_ = false;
      decode_graphs_.clear();
      return std::nullopt;
    }
    if (capturing) {
      finish(g);
      if (first_error) std::rethrow_exception(first_error);
    } else {
      ++launched;
    }
  }
  finish_launched();
  if (first_error) std::rethrow_exception(first_error);
  std::vector<at::Tensor> logits;
  for (size_t i = 0; i < parts.size(); ++i) {
    logits.push_back(graphs[i]->logits.narrow(0, 0, static_cast<int64_t>(parts[i].layout.size())));
  }
  return logits.size() == 1 ? logits[0] : at::cat(logits);
}

void Generator::forward_and_choose(const CausalLM& lm, const std::vector<Sequence*>& sequences,
                                   const std::vector<StepSequence>& layout, LatencyClass latency,
                                   const std::function<at::Tensor()>& forward) {
  at::Tensor logits;
  try {
    LatencyScope scope(lm.client, latency);
    // [Executor restart] (client_runtime/client.cpp): a step whose calls ordered on the GPU lost
    // their results runs again on the new connection; it writes the same cache positions again.
    redo_if_results_lost("a generation step", [&] { logits = forward(); });
  } catch (const c10::Error& e) {
    // The step's requests end with the error; the generator goes on with the others.
    for (auto* s : sequences) finish(*s, FinishReason::kError, e.what_without_backtrace());
    return;
  }
  const auto fp32 = logits.to(at::kFloat);
  std::vector<TokenSampler*> samplers;
  for (auto* s : sequences) {
    if (options_.logits_observer) options_.logits_observer(s->id, logits[static_cast<int64_t>(samplers.size())]);
    samplers.push_back(&s->sampler);
  }
  const auto tokens = choose_tokens(fp32, samplers);
  // Log-probabilities: of every row's token in one gather, and the most any row asks of the
  // likeliest in one topk, each one copy to the host.
  int64_t most_top = 0;
  bool any_logprobs = false;
  for (const auto* s : sequences) {
    most_top = std::max(most_top, s->params.top_logprobs);
    any_logprobs = any_logprobs || s->params.logprobs;
  }
  at::Tensor chosen_logprobs, top_values, top_ids;
  if (any_logprobs || most_top > 0) {
    const auto log_probs = fp32.log_softmax(-1);
    const auto chosen = at::tensor(tokens, at::kLong).to(log_probs.device()).unsqueeze(1);
    chosen_logprobs = log_probs.gather(1, chosen).squeeze(1).cpu();
    if (most_top > 0) {
      auto [values, ids] = log_probs.topk(most_top);
      top_values = values.cpu().contiguous();
      top_ids = ids.cpu().contiguous();
    }
  }
  for (size_t i = 0; i < sequences.size(); ++i) {
    auto& s = *sequences[i];
    const int64_t token = tokens[i];
    const auto row = static_cast<int64_t>(i);
    TokenEvent event;
    event.request = s.id;
    event.token = token;
    if (s.params.logprobs) event.logprob = chosen_logprobs.data_ptr<float>()[row];
    for (int64_t k = 0; k < s.params.top_logprobs; ++k) {
      event.top_logprobs.emplace_back(top_ids.data_ptr<int64_t>()[row * most_top + k],
                                      top_values.data_ptr<float>()[row * most_top + k]);
    }
    s.result.output_ids.push_back(token);
    s.cached += layout[i].length;
    s.next_token = token;
    const auto& stops = s.params.stop_tokens;
    const bool stopped_after = s.stop_after && s.stop_after(token);  // sees every token
    if (stopped_after || std::find(stops.begin(), stops.end(), token) != stops.end()) {
      event.finished = FinishReason::kStop;
    } else if (static_cast<int64_t>(s.result.output_ids.size()) >= s.params.max_new_tokens) {
      event.finished = FinishReason::kLength;
    }
    if (event.finished) finish(s, *event.finished);
    if (s.callback) s.callback(event);
  }
}

}  // namespace symbiosis
