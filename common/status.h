#pragma once
// [Error model] One error model per boundary. Inside a part, LibTorch-style checks throw
// (TORCH_CHECK with a message naming the bad value and what was expected). Across the executor's
// internal boundaries (call checks, transport choice, channel set-up) and onto the wire, an error
// is a value: a Status with a code and a message (LevelDB and Triton style). wire::to_proto
// (transport/zmq_wire.h) is the one place a Status becomes the wire's ErrorCode, and
// status_of_exception the one place an exception inside the executor becomes a Status.
#include <exception>
#include <optional>
#include <string>
#include <utility>

namespace symbiosis {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument = 1,     // a field of a request is wrong
  kNotFound = 2,            // an unknown layer id
  kResourceExhausted = 3,   // over a size limit
  kMalformed = 4,           // a header or frames that do not parse
  kFailedPrecondition = 5,  // e.g. a request before the handshake, a model hash mismatch
  kInternal = 6,
  kPermissionDenied = 7,  // a key not admitted or revoked; an operator request without an operator key
  kUnavailable = 8,       // the executor cannot serve: a part of a sharded executor is gone
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or the Status that says why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}          // NOLINT: implicit, as absl::StatusOr
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT
  bool is_ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  const T& value() const& { return *value_; }
  T& value() & { return *value_; }
  T&& value() && { return std::move(*value_); }

 private:
  Status status_;
  std::optional<T> value_;
};

// An exception thrown by a part (a failed TORCH_CHECK, a CUDA or ZeroMQ error) as a Status of
// `code`, its message without LibTorch's backtrace.
Status status_of_exception(const std::exception& e, StatusCode code);

}  // namespace symbiosis
