#pragma once
// [Untrusted input]
// What a peer sends is never echoed or logged whole: an error or a log line quotes at most a short
// prefix of a peer's string (bounded), and lines about bad input are rate-limited (LogBudget), so
// that a flood of bad messages neither grows the log without end nor reflects megabytes back.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace symbiosis {

// `text` as an error may quote it: at most `limit` bytes, then how long it was.
inline std::string bounded(std::string_view text, size_t limit = 64) {
  if (text.size() <= limit) return std::string(text);
  return std::string(text.substr(0, limit)) + "... (" + std::to_string(text.size()) + " bytes)";
}

// At most `per_window` lines per window; take() says whether one more may be written, and when a
// window opens after lines were held back, how many (for one "N more held back" line).
class LogBudget {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogBudget(int per_window, Clock::duration window = std::chrono::seconds(10))
      : per_window_(per_window), window_(window) {}

  bool take(uint64_t* held_back) {
    const auto now = Clock::now();
    *held_back = 0;
    if (now - window_start_ >= window_) {
      *held_back = held_;
      held_ = 0;
      used_ = 0;
      window_start_ = now;
    }
    if (used_ < per_window_) {
      used_++;
      return true;
    }
    held_++;
    return false;
  }

 private:
  int per_window_;
  Clock::duration window_;
  Clock::time_point window_start_{};
  int used_ = 0;
  uint64_t held_ = 0;
};

}  // namespace symbiosis
