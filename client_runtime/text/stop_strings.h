#pragma once
// [Stop strings]: text that ends a generation request, as vLLM's `stop` and transformers'
// `stop_strings` do. Generated ids are fed one at a time; the request ends with the token whose text
// completes a stop string (wherever it begins: inside a token, or across several), and the text given
// back stops right before it (vLLM's default: the stop string is not part of the output). While the
// text so far ends in what may begin a stop string, that tail is held back, so a stream never shows
// part of one. Not thread-safe; the Tokenizer must outlive it.
#include <cstdint>
#include <string>
#include <vector>

#include "client_runtime/text/streaming_decoder.h"
#include "client_runtime/text/tokenizer.h"

namespace symbiosis {

class StopStrings {
 public:
  // Throws c10::Error when a stop string is empty (it would end every request at once).
  StopStrings(const Tokenizer& tokenizer, std::vector<std::string> stops);

  // The text `id` adds that is final: it neither holds nor may begin a stop string ("" once stopped;
  // ids the tokenizer has no text for add none).
  std::string push(int64_t id);
  // Whether a stop string was completed: the request should end with the last id pushed.
  bool stopped() const { return stopped_; }
  // The text held back, at the end of a request that no stop string ended ("" if one did).
  std::string finish();

 private:
  StreamingDecoder decoder_;
  const Tokenizer& tokenizer_;
  std::vector<std::string> stops_;
  std::string pending_;  // text not given back yet: a tail that may begin a stop string
  bool stopped_ = false;
};

}  // namespace symbiosis
