#pragma once
// A tenant's generation engine: requests of prompt token ids in, tokens out as they are produced,
// with continuous batching over one KV cache (models/kv_cache.h). The model is a CausalLM, split
// (base layers on the executor) or monolithic, with whatever adapter it carries; the adapter is
// read as it is at each step, so a tenant may train it between steps (the loop of
// reinforcement-learning tenants) with no copy of weights anywhere.
//
// [Continuous batching] Each step() is a step boundary: requests submitted since the last one
// join (as many as the cache has free slots), cancelled ones leave, and then
//  1. the new requests' prompts (and their adapter's virtual tokens) are prefilled together as one
//     packed forward, which also gives each its first token;
//  2. every running request decodes one token, all in one forward.
// A request leaves as soon as it is done (a stop token or stop_after, max_new_tokens, cancelled) and its slot
// takes the next waiting request at the next boundary, so a tenant serving many users keeps its
// batch full. Prefill calls carry the latency class kInferencePrefill and decode calls
// kInferenceDecode (the executor serves decode first: [Inference first] in
// base_executor/batching.h); the client's class is restored after the step.
//
// [Captured decode] On a GPU, decode steps run from CUDA graphs, one per bucket of batch sizes
// (powers of two, the last one max_sequences): a step of B sequences runs the graph of the
// smallest bucket that holds B, its other rows padding that write to a spare slot of the cache and
// whose logits are dropped (a generator of one sequence has one bucket and no spare slot). A
// bucket's graph is captured after `capture_warmup` eager runs of it and replayed after: the
// step's host work (some thousand kernel launches and, split, its
// base-layer calls: [Captured steps] in training/step_graph.h) becomes one graph launch and the
// calls' headers. The captured step reads its token ids, cache slots and positions from device
// tensors filled before each replay and attends over the whole cache, masked to each sequence's
// length (CachedStep::fixed_decode), so the same graph serves every step. Prefill stays eager
// (its shapes vary). A client whose transport cannot be captured (anything but a same-GPU client
// over the shared-memory control channel) decodes eagerly, as on a CPU.
//
// [Decode halves] (GeneratorOptions::decode_halves; issue 45's item 4): a split model's decode step
// waits for each of its base-layer calls, some 65 hand-offs a step, while the executor waits for
// the tenant's kernels between them: they take turns. With decode_halves, a step of two sequences
// or more runs as two halves (the first ceil(B / 2) sequences, and the rest), each its own forward
// over the shared cache, the second's calls on a second connection to the executor (the same
// options, tenant "NAME/half2", lane 1: [Runs launched together] never puts a tenant's two halves in
// one launch): a captured half is its own graph on its own stream, both launched
// before either is waited for, so that one half's kernels run while the other's call is at the
// executor, and the executor's runs of the two connections are independent. Each half is exact on
// its own (a decode row depends on its sequence alone), so the step gives what it gives whole. A
// capture (the first replay of a bucket's half) runs its halves one after the other. Not with
// [Host decode] or offload_cache, and only for a split model.
//
// [Multi-adapter batches] (peft/lora_bank.h): a generator serves several LoRA adapters at once.
// load_adapter() reads and checks an adapter's PEFT files on the calling thread and names it; from
// the next step boundary it sits in a slot of the generator's LoraBank, and requests that name it
// (GenerationRequest::adapter) run in the same batches as every other request: one forward per
// step, each base layer one executor call for the whole batch, each row taking its own adapter (on
// a GPU in one grouped kernel per layer, which captured decode steps replay with the rows' slots
// filled before each replay as their token ids are). A request that names no adapter gets the
// model's own adapter (a generator built with one) or the base alone. unload_adapter() forgets the
// name at once (later requests naming it are refused); the requests already submitted with it run
// to their end on it, and its slot is freed at the first step boundary after the last of them.
// At most max_loras adapters are held at once, unloaded ones still finishing included. Loading or
// unloading an adapter that adapts layers no other adapter does wraps or unwraps those layers, and
// the captured decode graphs are captured again. Not with [Host decode], nor with an own adapter
// other than plain LoRA in the model's dtype (refused by load_adapter, saying so).
//
// Threads: submit(), cancel(), load_adapter(), unload_adapter() and adapters() may be called from
// any thread; step(), run() and generate() from
// one thread at a time (the loop that owns the cache). Callbacks run on the stepping thread.
#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "client_runtime/inference/heterogeneous.h"
#include "client_runtime/inference/sampling.h"
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/models/kv_cache.h"
#include "client_runtime/peft/lora_bank.h"

namespace symbiosis {

struct GenerationRequest {
  std::vector<int64_t> prompt_ids;
  SamplingParams sampling;
  // Called on the stepping thread with each token the request produces, before its callback: true
  // ends the request with that token, as a stop token does (finish reason kStop). What decides on
  // more than one token, such as [Stop strings] (text/stop_strings.h), keeps its state here. Optional.
  std::function<bool(int64_t token)> stop_after;
  // [Multi-adapter batches]: the name of a loaded adapter (Generator::load_adapter) to generate
  // with; empty: the model's own adapter when it has one, else the base model alone.
  std::string adapter;
};

enum class FinishReason { kStop, kLength, kCancelled, kError };
const char* to_string(FinishReason reason);  // "stop", "length", "cancelled", "error"

// One event of a request: a produced token, its last one (finished set), or only its end
// (cancelled, or an error of the step it was in: token -1).
struct TokenEvent {
  uint64_t request = 0;
  int64_t token = -1;
  float logprob = 0.0f;  // when the request asked for logprobs
  // The request's top_logprobs most likely tokens at this step and their log-probabilities, most
  // likely first (when it asked).
  std::vector<std::pair<int64_t, float>> top_logprobs;
  std::optional<FinishReason> finished;
  std::string error;  // kError: what went wrong
};
using TokenCallback = std::function<void(const TokenEvent&)>;

struct GenerationResult {
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> output_ids;
  std::vector<float> logprobs;  // one per output token, when asked
  FinishReason finish_reason = FinishReason::kLength;
  std::string error;
};

struct GeneratorOptions {
  int64_t max_sequences = 8;          // cache slots: requests decoded at once
  int64_t max_tokens = 1024;          // cache positions per request: virtual tokens + prompt + new tokens
  int64_t max_waiting = 4096;         // requests waiting for a slot; submit() refuses beyond
  int64_t max_prefill_tokens = 8192;  // prompt tokens one step prefills (a longer single prompt goes alone)
  bool capture_decode = true;         // GPU: decode steps in CUDA graphs ([Captured decode]); false: eager
  int capture_warmup = 2;             // eager decode steps of a bucket before its capture (at least 1)
  bool decode_halves = false;         // [Decode halves]: a split model's decode steps in two halves
  // The most bytes the KV cache may take when it lives in host memory (a CPU generator, or
  // [Host decode]); 0: no limit. A generator whose cache (max_sequences x max_tokens) exceeds it,
  // or a request whose positions would, is refused naming the sizes.
  int64_t host_cache_capacity_bytes = 0;
  // [Offloaded decode] (models/kv_cache.h): the KV cache in host memory (page-locked for a GPU model)
  // and every layer's keys and values copied to the model's device at each decode step, the next
  // layer's while one computes: the baseline users have today (transformers' OffloadedCache), which
  // [Host decode] is measured against. Decode steps are eager (no CUDA graphs); host_cache_capacity_bytes
  // bounds the cache. Not with [Host decode].
  bool offload_cache = false;
  // Called with each produced token's logits [vocab] (the model's dtype, on its device) before the
  // choice: for inspection, tests and constrained decoding. Optional.
  std::function<void(uint64_t request, const at::Tensor& logits)> logits_observer;
  // [Multi-adapter batches]: the most adapters load_adapter may hold at once (vLLM's max_loras; 0:
  // none), and the largest rank a layer of one may have (vLLM's max_lora_rank, 1 to 512). Nothing is
  // allocated for them until an adapter is loaded.
  int64_t max_loras = 8;
  int64_t max_lora_rank = 64;
  void validate() const;  // throws naming the field
};

class Generator {
 public:
  // Allocates the cache (max_sequences x max_tokens) in the model's dtype on its device.
  explicit Generator(CausalLM lm, GeneratorOptions options = {});
  // [Host decode] (inference/heterogeneous.h): prefills with `prefill` (its client layers on their
  // device, a GPU), keeps the cache in host memory (pinned when `prefill` is on a GPU) and decodes
  // with `host_decode`, a CPU copy of the same model with the same adapter kind (split over a client
  // of its own with device "cpu", or monolithic), whose adapter is kept equal to prefill's. Decode
  // steps are eager (no CUDA graphs). Throws naming what differs when the two models do not match.
  Generator(CausalLM prefill, CausalLM host_decode, GeneratorOptions options);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Queues a request; it joins at the next step boundary. Returns its id. Throws c10::Error naming
  // the field and the allowed range when the request is refused (empty or out-of-vocabulary
  // prompt, bad sampling parameters, more positions than the cache holds per request, the waiting
  // queue full); the generator's other requests are not affected.
  uint64_t submit(GenerationRequest request, TokenCallback on_token = {});
  // [Multi-adapter batches]: reads the LoRA adapter in `peft_dir` (adapter_config.json +
  // adapter_model.safetensors) and serves it as `name` from the next step boundary; requests may
  // name it as soon as this returns. Throws c10::Error naming what is wrong, having loaded nothing:
  // an empty or already loaded name, max_loras adapters held, another peft_type than LORA (naming
  // it) or DoRA, a rank above max_lora_rank, an adapter of another base model (target modules that
  // match no layer, tensors of other names or shapes), a [Host decode] generator, a model whose own
  // adapter is not plain LoRA in its dtype.
  void load_adapter(const std::string& name, const std::filesystem::path& peft_dir);
  // The same from the files' contents in memory (a trainer's adapter it just saved), checked alike.
  void load_adapter(const std::string& name, const AdapterContents& adapter);
  // Forgets `name` now; its running and waiting requests finish on it, and its slot is freed at the
  // step boundary after the last. Throws naming the loaded adapters when `name` is not one.
  void unload_adapter(const std::string& name);
  // The names of the loaded adapters, sorted.
  std::vector<std::string> adapters() const;

  // Ends the request at the next step boundary (its callback gets kCancelled); unknown or finished
  // ids are ignored.
  void cancel(uint64_t request);

  // One step (see [Continuous batching]); false when there was nothing to do.
  bool step();
  // Steps until no request is running or waiting.
  void run();
  // Submits every request, runs, and returns their results in order (what a batch job wants). A
  // request submit() refuses throws its error, and none of them runs.
  std::vector<GenerationResult> generate(const std::vector<GenerationRequest>& requests);

  int64_t running() const;  // requests holding a cache slot
  // Decode buckets with a graph captured so far ([Captured decode]; with [Decode halves], a bucket of
  // one half's size).
  int64_t captured_batch_sizes() const;
  const KvCache& cache() const;

 private:
  // load_adapter's checks and naming around `read`, which gives the adapter.
  void add_adapter(const std::string& name, const std::function<BankedLora()>& read);
  struct Sequence;
  struct Submitted;
  struct DecodeGraph;
  struct NamedLora;
  // [Multi-adapter batches] at a step boundary: loaded adapters take their slots, unloaded ones no
  // request holds leave theirs.
  void update_bank();
  // The rows' slots of a step of `layout` for the bank's layers: each sequence's slot over its
  // tokens (or once, `last_only`, for the logits); nothing without a bank.
  void set_bank_rows(const std::vector<StepSequence>& layout, bool last_only);
  void set_step_slots(const std::vector<Sequence*>& sequences);  // step_slots_ of a step of these
  int32_t bank_slot(const Sequence& sequence) const;             // its adapter's slot in bank_ (-1: none)
  // "a, b" or "none": the loaded adapters' names, for errors. Under mutex_.
  std::string adapter_names() const;
  void take_incoming();  // submitted requests join the waiting queue; cancelled ones leave
  void prefill(const std::vector<Sequence*>& sequences);
  void decode();
  // The bucket of a decode step of `sequences` sequences ([Captured decode]).
  int64_t decode_bucket(int64_t sequences) const;
  // One forward of a decode step: all its sequences, or one half of them ([Decode halves]; half 1
  // calls the executor over half_client_).
  struct DecodePart {
    int half = 0;
    std::vector<Sequence*> sequences;
    std::vector<StepSequence> layout;
    std::vector<int64_t> tokens;
  };
  // Logits [sequences, vocab] of a decode step's parts, in their order, each through its bucket's
  // graph; nullopt when a capture failed (the step is then to run eagerly: capture_ is off).
  std::optional<at::Tensor> decode_captured(const std::vector<DecodePart>& parts);
  at::Tensor decode_eager(const std::vector<DecodePart>& parts);
  DecodeGraph& decode_graph(int half, int64_t bucket);
  // Fills `graph`'s inputs from `part` (and step_slots_, set for it).
  void set_decode_inputs(DecodeGraph& graph, const DecodePart& part) const;
  // Runs `forward` (a step's logits, one row per sequence) with `lm`'s client under the latency
  // class and hands each sequence its next token; a failed step ends its sequences with the error.
  void forward_and_choose(const CausalLM& lm, const std::vector<Sequence*>& sequences,
                          const std::vector<StepSequence>& layout, LatencyClass latency,
                          const std::function<at::Tensor()>& forward);
  // One step of `lm` (whose CachedModel is `model`) over the cache, computing where `lm` lies.
  at::Tensor forward_eager(const CausalLM& lm, CachedModel& model, const std::vector<StepSequence>& layout,
                           const at::Tensor& embeddings);
  Generator(CausalLM lm, std::optional<CausalLM> host_decode, GeneratorOptions options);
  void connect_half_client();  // [Decode halves]: half_client_, checked against lm_.client
  const CausalLM& decode_lm() const { return host_decode_ ? *host_decode_ : lm_; }
  CachedModel& decode_model() const { return host_decode_ ? *host_decode_model_ : model_; }
  void finish(Sequence& sequence, FinishReason reason, const std::string& error = {});
  int64_t virtual_tokens() const;  // the adapter's prompt or prefix length

  CausalLM lm_;  // prefills, and decodes too unless host_decode_
  CachedModel& model_;
  std::optional<CausalLM> host_decode_;  // [Host decode]: decodes on the CPU
  CachedModel* host_decode_model_ = nullptr;
  std::unique_ptr<AdapterMirror> adapter_mirror_;  // [Host decode]: host_decode_'s adapter follows lm_'s
  GeneratorOptions options_;
  int64_t vocab_size_ = 0;
  std::unique_ptr<KvCache> cache_;
  bool capture_ = false;  // decode in CUDA graphs ([Captured decode]); off after a capture fails
  std::map<std::pair<int64_t, int>, std::unique_ptr<DecodeGraph>> decode_graphs_;  // by bucket and half
  std::shared_ptr<Client> half_client_;  // [Decode halves]: the second half's connection

  // Guards next_id_, queued_, incoming_ and cancelled_: what other threads hand to the stepping thread.
  mutable std::mutex mutex_;
  uint64_t next_id_ = 1;
  int64_t queued_ = 0;  // submitted requests without a cache slot yet (incoming_ and waiting_)
  std::deque<std::unique_ptr<Submitted>> incoming_;
  std::unordered_set<uint64_t> cancelled_;
  // [Multi-adapter batches]: the loaded adapters by name, those not in a slot yet, and how many
  // unloaded ones still hold slots.
  std::map<std::string, std::shared_ptr<NamedLora>> named_loras_;
  std::vector<std::shared_ptr<NamedLora>> loras_to_slot_;
  int64_t unloaded_holding_ = 0;
  std::unique_ptr<BankModel> bank_model_;  // the model as load_adapter checks adapters against it

  // Owned by the stepping thread.
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::unique_ptr<LoraBank> bank_;                   // while adapters are loaded
  std::vector<std::shared_ptr<NamedLora>> slotted_;  // the adapters in bank_'s slots
  std::vector<int32_t> step_slots_;                  // the slot of each sequence of the step, in layout order
};

}  // namespace symbiosis
