#include "base_executor/call_check.h"

#include <string>

#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// The checks that need nothing but the model and the header.
Status check_layer_call(const BaseModel& model, uint64_t max_request_bytes, shm::CallHeader& h,
                        const std::vector<int64_t>& shape) {
  if (h.layer_id >= model.layer_count()) {
    return {StatusCode::kNotFound, "unknown layer id " + std::to_string(h.layer_id) + " (this executor serves " +
                                       std::to_string(model.layers().size()) + " layers and " +
                                       std::to_string(model.groups().size()) + " groups, ids 0.." +
                                       std::to_string(model.layer_count() - 1) + ")"};
  }
  const auto& layer = model.layer(h.layer_id);
  // Built only for an error: this runs for every call.
  auto where = [&] {
    return "request " + std::to_string(h.request_id) + " for layer " + std::to_string(layer.id) + " (" + layer.name +
           ")";
  };
  auto invalid = [](std::string message) { return Status(StatusCode::kInvalidArgument, std::move(message)); };
  if (h.op != proto::FORWARD && h.op != proto::BACKWARD_INPUT && h.op != proto::FORWARD_NO_BIAS) {
    return invalid(where() + ": op " + std::to_string(h.op) + " is not FORWARD, BACKWARD_INPUT or FORWARD_NO_BIAS");
  }
  if (!layer.activation.empty() && h.op != proto::FORWARD) {
    return invalid(where() + ": op " + wire::op_name(static_cast<proto::Op>(h.op)) +
                   (model.is_bridge(layer.id) ? " on an MLP bridge" : " on an MLP block") +
                   ", which computes FORWARD only ([MLP blocks] in base_executor/base_model.h)");
  }
  const auto expected_dtype = wire::to_proto(layer.dtype);
  if (h.dtype != expected_dtype) {
    const std::string got =
        proto::DType_IsValid(h.dtype) ? proto::DType_Name(static_cast<proto::DType>(h.dtype)) : std::to_string(h.dtype);
    return invalid(where() + ": dtype " + got + " does not match the layer's " + proto::DType_Name(expected_dtype));
  }
  const int64_t features = h.op == proto::BACKWARD_INPUT ? layer.out_features : layer.in_features;
  if (shape.size() != 2 || shape[0] < 1 || shape[1] != features) {
    return invalid(where() + " (" + wire::op_name(static_cast<proto::Op>(h.op)) + "): shape " + shape_text(shape) +
                   " should be [tokens >= 1, " + std::to_string(features) + "]");
  }
  h.tokens = shape[0];
  h.features = shape[1];
  // Compared by rows, so that no product of a client's numbers can overflow.
  const uint64_t row_bytes = static_cast<uint64_t>(h.features) * at::elementSize(layer.dtype);
  if (static_cast<uint64_t>(h.tokens) > max_request_bytes / row_bytes) {
    return {StatusCode::kResourceExhausted, where() + ": " + std::to_string(h.tokens) + " tokens of " +
                                                std::to_string(row_bytes) + " bytes exceed the executor's limit of " +
                                                std::to_string(max_request_bytes) + " bytes (--max-request-bytes)"};
  }
  return Status::ok();
}

}  // namespace

Status check_call(const BaseModel& model, uint64_t max_request_bytes, const Channel& channel, shm::CallHeader& h,
                  const std::vector<int64_t>& shape) {
  if (auto status = check_layer_call(model, max_request_bytes, h, shape); !status.is_ok()) return status;
  if (h.sequence != 0 && !channel.orders_by_flags()) {
    const auto sequence = h.sequence;
    h.sequence = 0;  // so that the refusal goes back as a reply
    return {StatusCode::kInvalidArgument, "request " + std::to_string(h.request_id) + " is numbered (sequence " +
                                              std::to_string(sequence) + "), but a " + channel.kind_name() +
                                              " call is answered by reply: send it with sequence 0"};
  }
  if (h.slot != 0 && (h.slot > shm::kCallSlots || h.sequence == 0)) {
    const auto slot = h.slot;
    h.slot = 0;  // its result flag cannot be set: the sequence answers it
    return {StatusCode::kInvalidArgument, "request " + std::to_string(h.request_id) + " names slot " +
                                              std::to_string(slot) + (h.sequence == 0 ? " without a sequence" : "") +
                                              "; a captured call has a sequence and a slot from 1 to " +
                                              std::to_string(shm::kCallSlots)};
  }
  const auto& layer = model.layer(h.layer_id);
  const int64_t out_features = h.op == proto::BACKWARD_INPUT ? layer.in_features : layer.out_features;
  const uint64_t element = at::elementSize(layer.dtype);
  const uint64_t in_bytes = h.tokens * h.features * element, out_bytes = h.tokens * out_features * element;
  if (auto status = channel.check_payload(h, in_bytes, out_bytes); !status.is_ok()) {
    return {status.code(), "request " + std::to_string(h.request_id) + " for layer " + std::to_string(h.layer_id) +
                               " (" + layer.name + "): " + status.message()};
  }
  return Status::ok();
}

}  // namespace symbiosis
