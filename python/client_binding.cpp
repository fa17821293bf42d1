// symbiosis._C: the Python binding of the C++ client (symbiosis::Client). Python tenants reuse the
// C++ client runtime whole: the handshake, the transports (tcp, shm, cuda-ipc, nccl), reconnection
// and the exactness guarantees are the same objects C++ tenants use ([Python tenants] in
// docs/python.md). The Python side (python/symbiosis/) builds the virtual layers on top of this.
//
// Tensors cross the boundary as they are: torch's own type caster (torch/csrc/utils/pybind.h)
// unwraps a Python tensor into the at::Tensor it holds and wraps a result back, with no copy.
// Every call that may wait on the executor releases the GIL, so other Python threads (and autograd's
// worker threads) run meanwhile; the Client serializes its calls itself.
//
// [GIL-free release]
// ZeroMQ sends a payload without copying it: its I/O thread drops the last reference to the tensor
// once the bytes are out. A tensor Python made is tied to its Python object, and dropping the last
// C++ reference to it then takes the GIL; if the thread holding the GIL waits for that I/O thread
// meanwhile (closing the client), neither goes on. So a call hands the client a detached alias of
// its tensor (same storage, no copy, no Python object), and a Client is destroyed without the GIL.
//
// Errors: the client throws c10::Error (an executor error, a refused option, a lost connection);
// here it becomes symbiosis.Error, a RuntimeError whose message is the C++ message without its
// backtrace, and ResultsLost becomes symbiosis.ResultsLost (a subclass). One place converts them:
// the translator registered in the module's body.
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#include "client_runtime/client.h"
#include "common/checkpoint.h"

namespace py = pybind11;

namespace symbiosis {
namespace {

LatencyClass parse_latency_class(const std::string& name) {
  if (name == "finetune" || name == "fine-tuning") return LatencyClass::kFineTuning;
  if (name == "decode") return LatencyClass::kInferenceDecode;
  if (name == "prefill") return LatencyClass::kInferencePrefill;
  TORCH_CHECK(false, "latency class '", name, "' is not one of finetune, prefill, decode");
}

const char* latency_class_name(LatencyClass latency_class) {
  switch (latency_class) {
    case LatencyClass::kInferenceDecode: return "decode";
    case LatencyClass::kInferencePrefill: return "prefill";
    case LatencyClass::kFineTuning: return "finetune";
  }
  return "finetune";
}

// The client's own row of its layer table for `layer_id`; throws naming the id and the range.
const LayerInfo& layer_by_id(const Client& client, int64_t layer_id) {
  const auto& layers = client.layers();
  TORCH_CHECK(layer_id >= 0 && layer_id < static_cast<int64_t>(layers.size()), "layer id ", layer_id,
              " is not served: the executor serves ids 0..", static_cast<int64_t>(layers.size()) - 1);
  const auto& layer = layers[static_cast<size_t>(layer_id)];
  TORCH_CHECK(layer.id == static_cast<uint32_t>(layer_id), "layer table is not indexed by id");
  return layer;
}

// A Client whose destruction runs without the GIL ([GIL-free release]).
std::shared_ptr<Client> released_without_gil(std::shared_ptr<Client> client) {
  Client* raw = client.get();
  return std::shared_ptr<Client>(raw, [owner = std::move(client)](Client*) mutable {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      owner.reset();
    } else {
      owner.reset();
    }
  });
}

std::shared_ptr<Client> connect(const std::string& endpoint, const std::string& tenant, const std::string& device,
                                const std::string& transport, const std::string& expected_model_hash, int timeout_ms,
                                int connect_timeout_ms, int reconnect_ms, const std::string& latency_class,
                                const std::string& control, bool direct_operands, int spin_us,
                                const std::string& executor_key, const std::string& key_file, bool mask,
                                double noise_ratio, uint64_t mask_secret, int64_t mask_bank_rows,
                                int64_t mask_rotate_after, const std::string& mask_effects_checkpoint) {
  ClientOptions options;
  options.endpoint = endpoint;
  options.tenant = tenant;
  options.device = device;
  options.transport = transport;
  options.expected_model_hash = expected_model_hash;
  options.timeout_ms = timeout_ms;
  options.connect_timeout_ms = connect_timeout_ms;
  options.reconnect_ms = reconnect_ms;
  options.latency_class = parse_latency_class(latency_class);
  options.control = control;
  options.direct_operands = direct_operands;
  options.spin_us = spin_us;
  options.executor_key = executor_key;
  options.key_file = key_file;
  options.privacy.mask = mask;
  options.privacy.noise_ratio = noise_ratio;
  options.privacy.secret = mask_secret;
  options.privacy.bank_rows = mask_bank_rows;
  options.privacy.rotate_after = mask_rotate_after;
  options.privacy.effects_checkpoint = mask_effects_checkpoint;
  options.validate();
  std::shared_ptr<Client> client;
  {
    py::gil_scoped_release no_gil;
    client = Client::connect(options);
  }
  return released_without_gil(std::move(client));
}

}  // namespace

void bind_generator(py::module_& m);       // generator_binding.cpp
void bind_serving_engine(py::module_& m);  // serving_binding.cpp

}  // namespace symbiosis

PYBIND11_MODULE(_C, m) {
  using symbiosis::Client;
  using symbiosis::LayerInfo;
  m.doc() = "Symbiosis client runtime (C++), bound for Python tenants; use the symbiosis package";

  // Module-lifetime references, never released (no Python object is touched at process exit).
  static PyObject* error = py::exception<c10::Error>(m, "Error", PyExc_RuntimeError).release().ptr();
  static PyObject* results_lost = py::exception<symbiosis::ResultsLost>(m, "ResultsLost", error).release().ptr();
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const symbiosis::ResultsLost& e) {
      py::set_error(results_lost, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      py::set_error(error, e.what_without_backtrace());
    }
  });

  m.def(
      "model_hash",
      [](const std::string& checkpoint) {
        py::gil_scoped_release no_gil;  // hashes the weights' bytes once (then cached beside them)
        return symbiosis::Checkpoint::open(checkpoint)->model_hash();
      },
      py::arg("checkpoint"), "the model hash of a checkpoint folder, as an executor serving it reports it");

  py::class_<LayerInfo>(m, "LayerInfo", "One row of the executor's layer table")
      .def_readonly("id", &LayerInfo::id)
      .def_readonly("name", &LayerInfo::name, "checkpoint name without .weight")
      .def_property_readonly(
          "kind", [](const LayerInfo& l) { return std::string(symbiosis::layer_kind_name(l.kind)); },
          "'Linear' (weight [out, in]) or 'Conv1D' (weight [in, out])")
      .def_readonly("in_features", &LayerInfo::in_features)
      .def_readonly("out_features", &LayerInfo::out_features)
      .def_readonly("bias", &LayerInfo::bias, "whether the executor adds a bias")
      .def_readonly("dtype", &LayerInfo::dtype, "what the executor computes in")
      .def_readonly("members", &LayerInfo::members)
      // Immutable: a copy of a virtualized model (copy.deepcopy) shares its rows.
      .def("__copy__", [](const LayerInfo& l) { return l; })
      .def("__deepcopy__", [](const LayerInfo& l, const py::dict&) { return l; })
      .def("__repr__", [](const LayerInfo& l) {
        return "LayerInfo(id=" + std::to_string(l.id) + ", name='" + l.name +
               "', kind=" + symbiosis::layer_kind_name(l.kind) + ", in=" + std::to_string(l.in_features) +
               ", out=" + std::to_string(l.out_features) + ", bias=" + (l.bias ? "True" : "False") + ")";
      });

  py::class_<Client, std::shared_ptr<Client>>(m, "Client", "A tenant's connection to a base executor")
      .def_static("connect", &symbiosis::connect, py::arg("endpoint"), py::arg("tenant") = "default",
                  py::arg("device") = "cpu", py::arg("transport") = "auto", py::arg("expected_model_hash") = "",
                  py::arg("timeout_ms") = 60000, py::arg("connect_timeout_ms") = 10000, py::arg("reconnect_ms") = 60000,
                  py::arg("latency_class") = "finetune", py::arg("control") = "auto", py::arg("direct_operands") = true,
                  py::arg("spin_us") = -1, py::arg("executor_key") = "", py::arg("key_file") = "",
                  py::arg("mask") = false, py::arg("noise_ratio") = 4.0, py::arg("mask_secret") = 0,
                  py::arg("mask_bank_rows") = 256, py::arg("mask_rotate_after") = 0,
                  py::arg("mask_effects_checkpoint") = "")
      .def("layers", &Client::layers, py::return_value_policy::copy)
      .def(
          "forward",
          [](Client& c, int64_t layer_id, const at::Tensor& x, bool with_bias) {
            const auto& layer = symbiosis::layer_by_id(c, layer_id);
            const at::Tensor input = x.detach();  // [GIL-free release]
            py::gil_scoped_release no_gil;
            return c.forward(layer, input, with_bias);
          },
          py::arg("layer_id"), py::arg("x"), py::arg("with_bias") = true,
          "x [tokens, in] in the layer's dtype, on this client's device -> x·Wᵀ (+ b)")
      .def(
          "backward_input",
          [](Client& c, int64_t layer_id, const at::Tensor& grad_out) {
            const auto& layer = symbiosis::layer_by_id(c, layer_id);
            const at::Tensor input = grad_out.detach();  // [GIL-free release]
            py::gil_scoped_release no_gil;
            return c.backward_input(layer, input);
          },
          py::arg("layer_id"), py::arg("grad_out"), "grad_out [tokens, out] -> grad_out·W")
      .def("settle", &Client::settle, py::call_guard<py::gil_scoped_release>(),
           "wait for every call made so far; raise the first executor error among them")
      .def("set_latency_class",
           [](Client& c, const std::string& name) { c.set_latency_class(symbiosis::parse_latency_class(name)); })
      .def_property_readonly(
          "latency_class",
          [](const Client& c) { return std::string(symbiosis::latency_class_name(c.latency_class())); })
      .def_property_readonly("client_id", &Client::client_id)
      .def_property_readonly("model_hash", &Client::model_hash)
      .def_property_readonly("transport", &Client::transport)
      .def_property_readonly("calls", &Client::calls)
      .def_property_readonly("connection", &Client::connection)
      .def_property_readonly("masked", [](const Client& c) { return c.noise_mask() != nullptr; });

  symbiosis::bind_generator(m);
  symbiosis::bind_serving_engine(m);
}
