#pragma once
// Errors as values, for the wire and the public API (LevelDB/Triton style). Inside the code
// LibTorch-style checks throw; `to_status` converts at the one boundary where that happens.
#include <string>
#include <utility>

namespace symbiosis {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument = 1,
  kNotFound = 2,
  kResourceExhausted = 3,
  kMalformed = 4,
  kFailedPrecondition = 5,
  kInternal = 6,
  kUnavailable = 7,
};

class Status {
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

}  // namespace symbiosis
