#include "client_runtime/text/stop_strings.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace symbiosis {

StopStrings::StopStrings(const Tokenizer& tokenizer, std::vector<std::string> stops)
    : decoder_(tokenizer), tokenizer_(tokenizer), stops_(std::move(stops)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    TORCH_CHECK(!stops_[i].empty(), "stop string ", i, " is empty, expected text that ends a request");
  }
}

// [Stop strings]
std::string StopStrings::push(int64_t id) {
  if (stopped_ || id < 0 || id >= tokenizer_.vocab_size()) return "";
  pending_ += decoder_.push(id);
  // The earliest stop string in what is pending (everything before it was given back, and held no
  // beginning of one).
  size_t first = std::string::npos;
  for (const auto& stop : stops_) first = std::min(first, pending_.find(stop));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that begins some stop string.
  size_t held = 0;
  for (const auto& stop : stops_) {
    for (size_t n = std::min(stop.size() - 1, pending_.size()); n > held; --n) {
      if (pending_.compare(pending_.size() - n, n, stop, 0, n) == 0) {
        held = n;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - held);
  pending_.erase(0, pending_.size() - held);
  return out;
}

std::string StopStrings::finish() {
  if (stopped_) return "";
  std::string out = pending_ + decoder_.finish();
  pending_.clear();
  return out;
}

}  // namespace symbiosis
