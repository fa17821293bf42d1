// symbiosis._C.ServingEngine: the C++ runtime's Generator (client_runtime/inference/generator.h) as a
// server's engine ([Serving engine]); python/symbiosis/serve/ builds symbiosis-serve on it.
//
// [Serving engine]
// A server's requests arrive one at a time, from many client connections, and each wants its tokens
// as they are produced; symbiosis.Generator's generate() (generator_binding.cpp) is a batch call
// instead. Here one C++ thread of the engine's own owns the Generator and steps it ([Continuous
// batching]) whenever a request waits or runs, without the GIL; Python threads submit and cancel
// requests and load or unload adapters, the Generator's thread-safe side ([Multi-adapter
// batches]). The stepping thread never takes the GIL: once a step is over it appends the step's
// events to an outbox and wakes a socket ([Wake sockets] in transport/call_ring.h) that the
// server's event loop watches; the loop then takes every event waiting at once (take_events) and
// hands each to its request's stream
// (python/symbiosis/serve/engine.py). So a step never waits for Python: with the GIL taken on the
// stepping thread, a server of 64 streams on an H200 served 4 045 tokens/s where its engine alone
// made 7 266, the step waiting for the event loop to let go of the GIL.
//
// An event carries the token, its log-probability and its `top_logprobs` most likely tokens (when
// asked: the Generator's, for the whole step at once), and the text it makes final: the checkpoint's tokenizer decodes the output as
// it grows and ends the request at a stop string ([Streaming decode] and [Stop strings] in
// client_runtime/text/), so a stream never shows part of a stop string and the request stops with
// the token that completes it, with no extra step.
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <condition_variable>
#include <iterator>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client_runtime/inference/generator.h"
#include "client_runtime/models/causal_lm.h"
#include "client_runtime/text/stop_strings.h"
#include "client_runtime/text/tokenizer.h"
#include "client_runtime/training/trainer.h"
#include "common/checkpoint.h"
#include "transport/call_ring.h"

namespace py = pybind11;

namespace symbiosis {
namespace {

class ServingEngine {
 public:
  // client: a _C.Client, or None (monolithic). max_loras and max_lora_rank: GeneratorOptions'
  // ([Multi-adapter batches]).
  ServingEngine(const std::string& checkpoint_dir, const py::object& native, const std::string& device,
                const std::string& dtype, int64_t max_sequences, int64_t max_tokens, int64_t max_waiting,
                int64_t max_loras, int64_t max_lora_rank, bool capture_decode, bool decode_halves) {
    const auto client = native.is_none() ? nullptr : native.cast<std::shared_ptr<Client>>();
    py::gil_scoped_release no_gil;  // reads the weights, and with a client waits on the executor
    auto checkpoint = Checkpoint::open(checkpoint_dir);
    tokenizer_ = Tokenizer::in_directory(checkpoint_dir);
    TORCH_CHECK(tokenizer_, "checkpoint ", checkpoint_dir,
                " has no tokenizer (tokenizer.json or tokenizer.model beside config.json): a server gives text");
    auto lm = open_causal_lm(*checkpoint, client, {parse_dtype_name(dtype), at::Device(device)});
    GeneratorOptions options;
    options.max_sequences = max_sequences;
    options.max_tokens = max_tokens;
    options.max_waiting = max_waiting;
    options.max_loras = max_loras;
    options.max_lora_rank = max_lora_rank;
    options.capture_decode = capture_decode;
    options.decode_halves = decode_halves;  // [Decode halves]
    generator_ = std::make_unique<Generator>(std::move(lm), options);
    stepper_ = std::thread([this] { step_loop(); });
  }

  ~ServingEngine() { shutdown(); }
  ServingEngine(const ServingEngine&) = delete;
  ServingEngine& operator=(const ServingEngine&) = delete;

  // Queues a request; returns its id. Its events follow through take_events(). Throws naming the
  // field of a refused request.
  uint64_t submit(std::vector<int64_t> prompt_ids, const std::string& adapter, int64_t max_new_tokens,
                  double temperature, int64_t top_k, double top_p, uint64_t seed, std::vector<int64_t> stop_token_ids,
                  std::vector<std::string> stop, bool logprobs, int64_t top_logprobs) {
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      TORCH_CHECK(!stopping_, "the serving engine is shut down: it takes no more requests");
    }
    auto request = std::make_shared<Request>(*tokenizer_, std::move(stop));
    GenerationRequest generation;
    generation.prompt_ids = std::move(prompt_ids);
    generation.adapter = adapter;
    auto& sampling = generation.sampling;
    sampling.max_new_tokens = max_new_tokens;
    sampling.temperature = temperature;
    sampling.top_k = top_k;
    sampling.top_p = top_p;
    sampling.seed = seed;
    sampling.stop_tokens = std::move(stop_token_ids);
    sampling.logprobs = logprobs;
    sampling.top_logprobs = top_logprobs;
    generation.stop_after = [request](int64_t token) {
      request->text += request->stops.push(token);
      return request->stops.stopped();
    };
    py::gil_scoped_release no_gil;
    uint64_t id = 0;
    {
      // The registry takes the id before the stepping thread can end the request.
      std::lock_guard<std::mutex> lock(requests_mutex_);
      id = generator_->submit(std::move(generation),
                              [this, request](const TokenEvent& event) { deliver(*request, event); });
      requests_[id] = request;
    }
    wake();
    return id;
  }

  void cancel(uint64_t id) {
    generator_->cancel(id);
    wake();
  }

  // [Multi-adapter batches]: the Generator's own, which may be called from any thread. `path` is a
  // PEFT folder, or a symbiosis-finetune run or checkpoint folder (its newest adapter), as
  // symbiosis-generate's --adapter takes it.
  void load_adapter(const std::string& name, const std::string& path) {
    py::gil_scoped_release no_gil;  // reads the adapter's files
    generator_->load_adapter(name, adapter_in(path));
  }
  // The same from an adapter's files' contents in memory: `tensors` by their names in
  // adapter_model.safetensors (host tensors, as a trainer's save hands them over), `folder` what
  // messages name (where the trainer wrote them).
  void load_adapter_contents(const std::string& name, const std::string& folder, const std::string& config_json,
                             const std::map<std::string, at::Tensor>& tensors) {
    AdapterContents adapter{folder, config_json, {}};
    for (const auto& [key, tensor] : tensors) adapter.tensors[key] = tensor.detach();
    py::gil_scoped_release no_gil;
    generator_->load_adapter(name, adapter);
  }
  // The slot is freed at a step boundary once no request holds it: the stepping thread is woken
  // for that step even when nothing runs, so that a load after this one finds the slot free.
  void unload_adapter(const std::string& name) {
    generator_->unload_adapter(name);
    wake();
  }
  std::vector<std::string> adapters() const { return generator_->adapters(); }

  int64_t running() const { return running_.load(); }
  int64_t waiting() const {
    std::lock_guard<std::mutex> lock(requests_mutex_);
    return static_cast<int64_t>(requests_.size()) - running_.load();
  }

  // Readable while events wait: woken after each step that produced events.
  int notify_fd() const { return notify_.reader(); }

  // Every event waiting, oldest first, as (request, token, logprob, top_logprobs, text,
  // finish_reason or None, error); token -1 for an end without one (cancelled, or an error).
  py::list take_events() {
    shm::drain(notify_.reader());  // first: an event appended after the swap below wakes it again
    std::vector<Delivery> taken;
    {
      std::lock_guard<std::mutex> lock(outbox_mutex_);
      taken.swap(outbox_);
    }
    py::list events;
    for (auto& d : taken) {
      events.append(py::make_tuple(d.request, d.token, d.logprob, d.top, d.text,
                                   d.finish_reason ? py::cast(*d.finish_reason) : py::none(), d.error));
    }
    return events;
  }

  // Cancels every request (each gets its "cancelled" event) and stops the stepping thread. Idempotent.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    wake_cv_.notify_all();
    if (stepper_.joinable()) {
      std::optional<py::gil_scoped_release> no_gil;  // the last steps may take a while
      if (PyGILState_Check()) no_gil.emplace();
      stepper_.join();
    }
  }

 private:
  // A request's state beside the Generator's: its text and stop strings. Touched by the stepping
  // thread only, once submitted.
  struct Request {
    Request(const Tokenizer& tokenizer, std::vector<std::string> stop) : stops(tokenizer, std::move(stop)) {}
    StopStrings stops;  // [Stop strings]: the output's final text
    std::string text;   // what the current token made final
  };

  void wake() {
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      ++wakeups_;
    }
    wake_cv_.notify_all();
  }

  // An event of a step, for the outbox once the step is over.
  struct Delivery {
    uint64_t request;
    int64_t token;
    float logprob;
    std::vector<std::pair<int64_t, float>> top;
    std::string text;
    std::optional<std::string> finish_reason;
    std::string error;
  };

  // On the stepping thread, within a step: the request's event, kept for deliver_all().
  void deliver(Request& request, const TokenEvent& event) {
    Delivery delivery{event.request,           event.token,  event.logprob, event.top_logprobs,
                      std::move(request.text), std::nullopt, event.error};
    request.text.clear();
    if (event.finished) {
      delivery.text += request.stops.finish();
      delivery.finish_reason = to_string(*event.finished);
      std::lock_guard<std::mutex> lock(requests_mutex_);
      requests_.erase(event.request);
    }
    deliveries_.push_back(std::move(delivery));
  }

  // On the stepping thread, after a step: its events to the outbox, the event loop woken.
  void deliver_all() {
    if (deliveries_.empty()) return;
    {
      std::lock_guard<std::mutex> lock(outbox_mutex_);
      std::move(deliveries_.begin(), deliveries_.end(), std::back_inserter(outbox_));
    }
    deliveries_.clear();
    shm::wake(notify_.writer());
  }

  void step_loop() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        wake_cv_.wait(lock, [&] { return stopping_ || wakeups_ > 0; });
        wakeups_ = 0;
        if (stopping_) break;
      }
      while (step_once()) {
        std::lock_guard<std::mutex> lock(wake_mutex_);
        if (stopping_) break;
      }
    }
    // Every request still known ends "cancelled", its stream told.
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(requests_mutex_);
      for (const auto& [id, request] : requests_) ids.push_back(id);
    }
    for (const auto id : ids) generator_->cancel(id);
    while (step_once()) {
    }
  }

  bool step_once() {
    bool stepped = false;
    try {
      stepped = generator_->step();
    } catch (const std::exception& e) {
      // The Generator ends a failed step's requests itself; what escapes is a bug: say so, go on.
      std::cerr << "symbiosis.ServingEngine: a generation step failed: " << e.what() << std::endl;
    }
    running_.store(generator_->running());
    deliver_all();
    return stepped;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Generator> generator_;
  std::vector<Delivery> deliveries_;  // the current step's events; the stepping thread's
  shm::WakeSocket notify_;            // [Wake sockets]: woken after each step with events (take_events drains it)
  std::mutex outbox_mutex_;           // guards outbox_
  std::vector<Delivery> outbox_;      // events not yet taken

  // Guards requests_: the requests submitted and not finished, by id.
  mutable std::mutex requests_mutex_;
  std::map<uint64_t, std::shared_ptr<Request>> requests_;
  std::atomic<int64_t> running_{0};  // the Generator's running(), as of the last step

  // Guards wakeups_ and stopping_: what wakes the stepping thread.
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
  int64_t wakeups_ = 0;
  bool stopping_ = false;
  std::thread stepper_;  // the stepping thread: owns generator_'s steps
};

}  // namespace

void bind_serving_engine(py::module_& m) {
  py::class_<ServingEngine>(m, "ServingEngine",
                            "The C++ runtime's Generator stepping on a thread of its own ([Serving engine])")
      .def(py::init<const std::string&, const py::object&, const std::string&, const std::string&, int64_t, int64_t,
                    int64_t, int64_t, int64_t, bool, bool>(),
           py::arg("checkpoint"), py::arg("client"), py::arg("device"), py::arg("dtype"), py::arg("max_sequences"),
           py::arg("max_tokens"), py::arg("max_waiting"), py::arg("max_loras"), py::arg("max_lora_rank"),
           py::arg("capture_decode"), py::arg("decode_halves"))
      .def("submit", &ServingEngine::submit, py::arg("prompt_ids"), py::arg("adapter"), py::arg("max_new_tokens"),
           py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stop_token_ids"),
           py::arg("stop"), py::arg("logprobs"), py::arg("top_logprobs"))
      .def_property_readonly("notify_fd", &ServingEngine::notify_fd)
      .def("take_events", &ServingEngine::take_events)
      .def("cancel", &ServingEngine::cancel, py::arg("request"))
      .def("load_adapter", &ServingEngine::load_adapter, py::arg("name"), py::arg("path"))
      .def("load_adapter_contents", &ServingEngine::load_adapter_contents, py::arg("name"), py::arg("folder"),
           py::arg("config_json"), py::arg("tensors"))
      .def("unload_adapter", &ServingEngine::unload_adapter, py::arg("name"))
      .def_property_readonly("adapters", &ServingEngine::adapters)
      .def("shutdown", &ServingEngine::shutdown)
      .def_property_readonly("running", &ServingEngine::running)
      .def_property_readonly("waiting", &ServingEngine::waiting);
}

}  // namespace symbiosis
