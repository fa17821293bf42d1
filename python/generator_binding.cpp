// symbiosis._C.Generator: the C++ runtime's Generator (client_runtime/inference/generator.h) for a
// Python tenant ([Python generation] in docs/python.md). The model is the C++ runtime's own copy of
// the checkpoint's client layers (split over the tenant's Client, or monolithic), with a PEFT
// adapter loaded from its files; continuous batching, the KV cache and, on a GPU, captured decode
// steps are the engine's, so a Python tenant decodes as fast as a C++ one. generate() releases the
// GIL for the whole run.
#include <torch/csrc/utils/pybind.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "client_runtime/inference/generator.h"
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/peft/adapter.h"
#include "client_runtime/training/trainer.h"
#include "common/checkpoint.h"

namespace py = pybind11;

namespace symbiosis {
namespace {

// The model and its engine; the Generator holds the model, and the model its client.
struct BoundGenerator {
  CausalLM lm;
  std::unique_ptr<Generator> generator;
};

// client: a _C.Client, or None (monolithic: the base layers computed here from the checkpoint).
std::unique_ptr<BoundGenerator> make_generator(const std::string& checkpoint_dir, const py::object& native,
                                               const std::string& adapter, const std::string& device,
                                               const std::string& dtype, int64_t max_sequences, int64_t max_tokens,
                                               bool capture_decode, bool decode_halves) {
  const auto client = native.is_none() ? nullptr : native.cast<std::shared_ptr<Client>>();
  py::gil_scoped_release no_gil;  // reads the weights, and with a client waits on the executor
  auto checkpoint = Checkpoint::open(checkpoint_dir);
  auto bound = std::make_unique<BoundGenerator>();
  bound->lm = open_causal_lm(*checkpoint, client, {parse_dtype_name(dtype), at::Device(device)});
  // A run folder or a checkpoint of one is taken too, as symbiosis-generate's --adapter takes it.
  if (!adapter.empty()) load_peft_adapter(*bound->lm.module, adapter_in(adapter));
  GeneratorOptions options;
  options.max_sequences = max_sequences;
  options.max_tokens = max_tokens;
  options.capture_decode = capture_decode;
  options.decode_halves = decode_halves;                      // [Decode halves]
  options.max_waiting = std::numeric_limits<int64_t>::max();  // generate() queues all its prompts at once
  bound->generator = std::make_unique<Generator>(bound->lm, options);
  return bound;
}

// Each prompt's result as a dict: prompt_ids, output_ids, finish_reason ("stop", "length",
// "cancelled", "error"), logprobs (when asked), error (when one happened).
py::list generate(BoundGenerator& bound, const std::vector<std::vector<int64_t>>& prompts, int64_t max_new_tokens,
                  double temperature, int64_t top_k, double top_p, uint64_t seed,
                  const std::vector<int64_t>& stop_token_ids, bool logprobs) {
  std::vector<GenerationRequest> requests(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    requests[i].prompt_ids = prompts[i];
    auto& sampling = requests[i].sampling;
    sampling.max_new_tokens = max_new_tokens;
    sampling.temperature = temperature;
    sampling.top_k = top_k;
    sampling.top_p = top_p;
    sampling.seed = seed + i;  // each prompt its own random stream, reproducible from `seed`
    sampling.stop_tokens = stop_token_ids;
    sampling.logprobs = logprobs;
  }
  std::vector<GenerationResult> results;
  {
    py::gil_scoped_release no_gil;
    results = bound.generator->generate(requests);
  }
  py::list out;
  for (const auto& result : results) {
    py::dict item;
    item["prompt_ids"] = result.prompt_ids;
    item["output_ids"] = result.output_ids;
    item["finish_reason"] = to_string(result.finish_reason);
    if (logprobs) item["logprobs"] = result.logprobs;
    if (!result.error.empty()) item["error"] = result.error;
    out.append(std::move(item));
  }
  return out;
}

}  // namespace

void bind_generator(py::module_& m) {
  py::class_<BoundGenerator>(m, "Generator", "The C++ runtime's generation engine for a Python tenant")
      .def(py::init(&make_generator), py::arg("checkpoint"), py::arg("client"), py::arg("adapter"), py::arg("device"),
           py::arg("dtype"), py::arg("max_sequences"), py::arg("max_tokens"), py::arg("capture_decode"),
           py::arg("decode_halves"))
      .def("generate", &generate, py::arg("prompts"), py::arg("max_new_tokens"), py::arg("temperature"),
           py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stop_token_ids"), py::arg("logprobs"))
      .def_property_readonly("captured_batch_sizes",
                             [](const BoundGenerator& g) { return g.generator->captured_batch_sizes(); });
}

}  // namespace symbiosis
