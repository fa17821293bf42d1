// symbiosis-generate: generate from a model and its PEFT adapter, against a running executor
// (split) or with the base layers in-process (--monolithic), over the Generator of
// client_runtime/inference/generator.h (continuous batching over one KV cache).
//
// --prompt TEXT: one request, its text tokenized with the checkpoint's tokenizer and the reply
// streamed to stdout as text as its tokens arrive.
//
// Otherwise, input (--input, "-" for stdin): JSON Lines, one request a line: {"prompt_ids": [...]}
// or {"prompt": "text"} and, optionally, the request's own "max_new_tokens", "temperature",
// "top_k", "top_p", "seed", "stop" (a string or a list of them), "stop_token_ids" and "logprobs" in
// place of the flags'. Output (stdout):
// one JSON line per request, as each finishes: {"index": line number from 1, "prompt_ids",
// "output_ids", "text" (the output decoded, when the checkpoint has a tokenizer), "finish_reason"
// ("stop", "length", "cancelled", "error"), "logprobs" when asked}. A line that is refused (not JSON, a field
// of the wrong type, a value outside its range) gets {"index", "error"} naming the field, and the
// other requests go on; the exit status is then 1.
//
// --host-decode: prefill on --device (a GPU), keep the KV cache in host memory and decode on the
// CPU with a CPU copy of the model and adapter, its base-layer calls over a client of its own
// (device cpu), or in-process with --monolithic ([Host decode] in inference/heterogeneous.h); give
// it --threads for the CPU's attention.
//
// --offload-cache: the baseline to --host-decode, with the model on --device (a GPU): the KV cache
// in host memory, each layer's keys and values copied to the GPU at each decode step, the next
// layer's while one computes ([Offloaded decode] in models/kv_cache.h; transformers' OffloadedCache).
//
// [Interrupted generation]: the first SIGINT or SIGTERM ends every request at the next step, each
// answered with what it produced so far (finish_reason "cancelled"; --prompt: the text so far, then
// a new line), and the exit status is 130 (143); a second signal ends the program at once.
//
// With a tokenizer, its EOS token ends a request (as transformers' generate stops at it), unless
// --stop-token-ids names the stop tokens. --stop TEXT (vLLM's `stop`; repeatable) ends a request
// with the token that completes TEXT, and the text stops before it ([Stop strings] in
// client_runtime/text/stop_strings.h). A model's vocabulary may be larger than its tokenizer's
// (padded to a multiple of 64, say): a token outside the tokenizer's has no text, and is left out of
// the text as Hugging Face tokenizers' decode leaves it out.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>

#include <symbiosis/client.h>
#include <symbiosis/inference.h>
#include <symbiosis/models.h>
#include <symbiosis/peft.h>
#include <symbiosis/text.h>
#include <symbiosis/training.h>

#include "examples/tenant_flags.h"

using namespace symbiosis;
using nlohmann::json;

namespace {

struct Settings {
  std::string model;
  examples::TenantFlags connection{.tenant = "generate"};
  std::string adapter;
  std::string device = "cpu";
  std::string dtype = "fp32";
  std::string input = "-";
  std::string prompt;  // --prompt: one request of text, streamed
  std::string stop_token_ids;
  std::vector<std::string> stop;  // [Stop strings]
  SamplingParams sampling;
  GeneratorOptions generator;
  bool host_decode = false;
  int threads = 1;
};

// A field of a request line, checked for its type; the error names the field and what it expected.
template <typename T>
T field(const json& line, const char* name, const T& fallback, const char* expected) {
  if (!line.contains(name)) return fallback;
  try {
    return line.at(name).get<T>();
  } catch (const json::exception&) {
    TORCH_CHECK(false, "field '", name, "' is ", line.at(name).dump(), ", expected ", expected);
  }
}

// A request's text as it is produced: `on_text` gets each final piece, and a stop string of `stop`
// ends the request ([Stop strings]). Null without a tokenizer (then there is no text, and no stop
// string may be given).
std::shared_ptr<StopStrings> follow_text(GenerationRequest& request, const Tokenizer* tokenizer,
                                         std::vector<std::string> stop,
                                         std::function<void(const std::string&)> on_text) {
  if (tokenizer == nullptr) {
    TORCH_CHECK(stop.empty(), "stop strings need the checkpoint's tokenizer (tokenizer.json or tokenizer.model beside ",
                "config.json); give stop token ids instead");
    return nullptr;
  }
  auto text = std::make_shared<StopStrings>(*tokenizer, std::move(stop));
  request.stop_after = [text, on_text = std::move(on_text)](int64_t token) {
    on_text(text->push(token));
    return text->stopped();
  };
  return text;
}

struct ParsedRequest {
  GenerationRequest request;
  std::vector<std::string> stop;
};

ParsedRequest parse_request(const std::string& text, const Settings& defaults, const Tokenizer* tokenizer) {
  json line;
  try {
    line = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "not a JSON object: ", e.what());
  }
  TORCH_CHECK(line.is_object(), "not a JSON object, expected {\"prompt_ids\": [...]} or {\"prompt\": \"text\"}");
  TORCH_CHECK(line.contains("prompt_ids") != line.contains("prompt"),
              "expected one of 'prompt_ids' (a list of token ids) and 'prompt' (text)");
  static const std::set<std::string> known = {"prompt_ids", "prompt", "max_new_tokens", "temperature",    "top_k",
                                              "top_p",      "seed",   "stop",           "stop_token_ids", "logprobs"};
  for (const auto& [key, value] : line.items()) {
    TORCH_CHECK(known.count(key), "field '", key.substr(0, 64),
                "' is unknown, expected only prompt_ids, prompt, "
                "max_new_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids and logprobs");
  }
  ParsedRequest parsed;
  auto& request = parsed.request;
  if (line.contains("prompt")) {
    TORCH_CHECK(tokenizer, "field 'prompt' is text, which needs the checkpoint's tokenizer (tokenizer.json or ",
                "tokenizer.model beside config.json); give 'prompt_ids' instead");
    request.prompt_ids = tokenizer->encode(field<std::string>(line, "prompt", {}, "a string"));
  } else {
    request.prompt_ids = field<std::vector<int64_t>>(line, "prompt_ids", {}, "a list of integer token ids");
  }
  auto& s = request.sampling;
  s = defaults.sampling;
  s.max_new_tokens = field<int64_t>(line, "max_new_tokens", s.max_new_tokens, "an integer");
  s.temperature = field<double>(line, "temperature", s.temperature, "a number");
  s.top_k = field<int64_t>(line, "top_k", s.top_k, "an integer");
  s.top_p = field<double>(line, "top_p", s.top_p, "a number");
  s.seed = field<uint64_t>(line, "seed", s.seed, "a non-negative integer");
  s.stop_tokens = field<std::vector<int64_t>>(line, "stop_token_ids", s.stop_tokens, "a list of integer token ids");
  s.logprobs = field<bool>(line, "logprobs", s.logprobs, "true or false");
  parsed.stop = line.contains("stop") && line.at("stop").is_string()
                    ? std::vector<std::string>{line.at("stop").get<std::string>()}
                    : field<std::vector<std::string>>(line, "stop", defaults.stop, "a string or a list of strings");
  return parsed;
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    size_t used = 0;
    try {
      out.push_back(std::stoll(item, &used));
    } catch (const std::exception&) {
    }
    TORCH_CHECK(used == item.size() && used > 0, "--stop-token-ids: '", item,
                "' is not a token id, expected integers separated by commas (stop text: --stop)");
  }
  return out;
}

const Tokenizer* tokenizer_for_prompt(const Tokenizer* tokenizer, const Checkpoint& checkpoint) {
  TORCH_CHECK(tokenizer, "--prompt: ", checkpoint.dir().string(),
              " has no tokenizer (tokenizer.json or tokenizer.model); give token ids through --input instead");
  return tokenizer;
}

// [Interrupted generation]
std::atomic<int> interrupted_by{0};

extern "C" void on_interrupt(int signal) {
  interrupted_by.store(signal);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  constexpr char kSaid[] = "symbiosis-generate: ending every request with what it has (again to stop at once)\n";
  [[maybe_unused]] const auto written = ::write(STDERR_FILENO, kSaid, sizeof(kSaid) - 1);
}

// Steps `generator` until it is done; once a signal came, cancels the requests in `ids` (each then
// answered with what it has). The exit status: 0, or 128 + the signal.
int run_until_done_or_interrupted(Generator& generator, const std::vector<uint64_t>& ids) {
  bool cancelled = false;
  while (true) {
    if (!cancelled && interrupted_by.load() != 0) {
      for (const uint64_t id : ids) generator.cancel(id);
      cancelled = true;
    }
    if (generator.step()) continue;
    generator.run();  // returns at once: nothing is left (no other thread submits)
    break;
  }
  const int signal = interrupted_by.load();
  return signal == 0 ? 0 : 128 + signal;
}

// --prompt: the reply's text on stdout as its tokens arrive.
int stream_prompt(const Settings& s, const Tokenizer& tokenizer, Generator& generator) {
  GenerationRequest request;
  request.prompt_ids = tokenizer.encode(s.prompt);
  request.sampling = s.sampling;
  const auto text =
      follow_text(request, &tokenizer, s.stop, [](const std::string& piece) { std::cout << piece << std::flush; });
  std::string error;
  const uint64_t id = generator.submit(std::move(request), [&](const TokenEvent& event) {
    if (!event.finished) return;
    std::cout << text->finish() << std::endl;
    if (!event.error.empty()) error = event.error;
  });
  const int status = run_until_done_or_interrupted(generator, {id});
  TORCH_CHECK(error.empty(), error);
  return status;
}

int run(Settings& s) {
  examples::require_device(s.device);
  auto checkpoint = Checkpoint::open(s.model);
  std::shared_ptr<Client> client;
  if (!s.connection.monolithic) {
    auto options = examples::client_options(s.connection, *checkpoint);
    options.device = s.device;
    client = Client::connect(options);
  }
  auto lm = open_causal_lm(*checkpoint, client, {parse_dtype_name(s.dtype), at::Device(s.device)});
  if (!s.adapter.empty()) s.adapter = adapter_in(s.adapter).string();  // a checkpoint or a run folder too
  if (!s.adapter.empty()) load_peft_adapter(*lm.module, s.adapter);
  const auto tokenizer = Tokenizer::in_directory(checkpoint->dir());
  s.sampling.stop_tokens = parse_ids(s.stop_token_ids);
  if (s.stop_token_ids.empty() && tokenizer && tokenizer->eos_token_id())
    s.sampling.stop_tokens = {*tokenizer->eos_token_id()};
  s.generator.max_waiting = std::numeric_limits<int64_t>::max();  // the whole file is queued at once
  std::unique_ptr<Generator> host_decoding;
  if (s.host_decode) {
    // [Host decode]: a CPU copy of the model and adapter decodes, over a client of its own.
    std::shared_ptr<Client> cpu_client;
    if (!s.connection.monolithic) {
      auto options = examples::client_options(s.connection, *checkpoint);
      options.device = "cpu";
      options.tenant += "-host-decode";
      cpu_client = Client::connect(options);
    }
    auto cpu_lm = open_causal_lm(*checkpoint, cpu_client, {parse_dtype_name(s.dtype), at::kCPU});
    if (!s.adapter.empty()) load_peft_adapter(*cpu_lm.module, s.adapter);
    host_decoding = std::make_unique<Generator>(lm, cpu_lm, s.generator);
  }
  auto plain = host_decoding ? nullptr : std::make_unique<Generator>(lm, s.generator);
  Generator& generator = host_decoding ? *host_decoding : *plain;
  if (!s.prompt.empty()) return stream_prompt(s, *tokenizer_for_prompt(tokenizer.get(), *checkpoint), generator);

  std::ifstream file;
  if (s.input != "-") {
    file.open(s.input);
    TORCH_CHECK(file.good(), "--input: cannot read ", s.input);
  }
  std::istream& in = s.input == "-" ? std::cin : file;
  bool refused = false;
  auto emit = [](const json& line) { std::cout << line.dump() << std::endl; };
  int64_t index = 0;
  std::vector<uint64_t> ids;
  for (std::string text; std::getline(in, text);) {
    ++index;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      auto [request, stop] = parse_request(text, s, tokenizer.get());
      auto reply = std::make_shared<json>(json{{"index", index}, {"prompt_ids", request.prompt_ids}});
      (*reply)["output_ids"] = json::array();
      const bool logprobs = request.sampling.logprobs;
      if (logprobs) (*reply)["logprobs"] = json::array();
      auto said = std::make_shared<std::string>();
      const auto text_of =
          follow_text(request, tokenizer.get(), std::move(stop), [said](const std::string& piece) { *said += piece; });
      ids.push_back(
          generator.submit(std::move(request), [reply, logprobs, emit, text_of, said](const TokenEvent& event) {
            if (event.token >= 0) {
              (*reply)["output_ids"].push_back(event.token);
              if (logprobs) (*reply)["logprobs"].push_back(event.logprob);
            }
            if (!event.finished) return;
            if (text_of) (*reply)["text"] = *said + text_of->finish();
            (*reply)["finish_reason"] = to_string(*event.finished);
            if (!event.error.empty()) (*reply)["error"] = event.error;
            emit(*reply);
          }));
    } catch (const c10::Error& e) {
      refused = true;
      emit({{"index", index}, {"error", e.what_without_backtrace()}});
    }
  }
  const int status = run_until_done_or_interrupted(generator, ids);
  return status != 0 ? status : refused ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  auto& p = s.sampling;
  auto& g = s.generator;
  CLI::App app{"symbiosis-generate: generate from a model and its adapter, against a shared executor"};
  app.add_option("--model", s.model, "the checkpoint directory (the executor serves the same)")->required();
  examples::add_tenant_flags(app, s.connection, /*monolithic_flag=*/true);
  app.add_option("--adapter", s.adapter,
                 "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), a symbiosis-finetune "
                 "checkpoint, or its --save-dir (the newest checkpoint's adapter)");
  app.add_option("--device", s.device, "where this client's model and cache live: cpu or cuda:N")
      ->capture_default_str();
  app.add_option("--dtype", s.dtype, "this client's model dtype: fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--prompt", s.prompt, "one prompt of text: the reply is streamed to stdout as text");
  app.add_option("--input", s.input, "JSON Lines of {\"prompt_ids\": [...]} or {\"prompt\": \"text\"}; - for stdin")
      ->capture_default_str();
  app.add_option("--max-new-tokens", p.max_new_tokens, "tokens to produce at most per request")->capture_default_str();
  app.add_option("--temperature", p.temperature, "0: greedy; > 0: sample at this temperature")->capture_default_str();
  app.add_option("--top-k", p.top_k, "sample among the k most likely tokens (0: all)")->capture_default_str();
  app.add_option("--top-p", p.top_p, "sample among the most likely tokens whose probability reaches p, in (0, 1]")
      ->capture_default_str();
  app.add_option("--seed", p.seed, "each request's random stream (a request's own \"seed\" overrides)")
      ->capture_default_str();
  app.add_option("--stop", s.stop, "text that ends a request, left out of its text (vLLM's stop; repeatable)");
  app.add_option("--stop-token-ids", s.stop_token_ids,
                 "comma-separated token ids that end a request, kept in its output "
                 "(default: the tokenizer's EOS)");
  app.add_flag("--logprobs", p.logprobs, "report each produced token's log-probability");
  app.add_option("--max-sequences", g.max_sequences, "requests decoded at once (KV cache slots)")
      ->capture_default_str();
  app.add_option("--max-tokens", g.max_tokens, "KV cache positions per request: prompt + new tokens")
      ->capture_default_str();
  bool eager = false;
  app.add_flag("--eager", eager,
               "on a GPU, decode without CUDA graphs (by default one graph per bucket of batch sizes)");
  app.add_flag("--host-decode", s.host_decode,
               "prefill on --device, keep the KV cache in host memory and decode on the CPU (a CPU copy of the model)");
  app.add_flag("--offload-cache", g.offload_cache,
               "keep the KV cache in host memory and copy each layer's to --device at each decode step "
               "(the baseline to --host-decode)");
  app.add_flag("--decode-halves", g.decode_halves,
               "split: each decode step's sequences in two halves over two connections to the executor, one "
               "computing while the other's calls are at the executor");
  app.add_option("--host-cache-capacity-bytes", g.host_cache_capacity_bytes,
                 "refuse a KV cache in host memory beyond this many bytes (0: no limit)")
      ->capture_default_str();
  app.add_option("--threads", s.threads, "CPU threads of this process")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  g.capture_decode = !eager;
  at::set_num_threads(s.threads);
  std::signal(SIGINT, on_interrupt);  // [Interrupted generation]
  std::signal(SIGTERM, on_interrupt);
  return examples::report_errors(s.connection, [&] { return run(s); });
}
