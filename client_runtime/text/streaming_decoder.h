#pragma once
// Streaming decode for generation: token ids fed one at a time, the text they complete given back as soon as it
// is final. [Streaming decode] A push decodes a window of the last ids twice, with and without the new one, and
// gives the difference: text is held back while it ends in an incomplete UTF-8 character (U+FFFD), and the
// window's earlier ids give a SentencePiece word marker ("▁") its context, so a space is neither dropped nor
// doubled. Byte-fallback tokens ("<0xE6>") are held back until a token of another kind follows: a run of them is
// decoded as one (an invalid run becomes U+FFFD for every byte, the valid characters before in it included), so a
// prefix of a run is not a prefix of its text. The pieces given back add up to Tokenizer::decode of all the ids
// pushed (tested on every family).
// Not thread-safe; the Tokenizer must outlive it.
#include <cstdint>
#include <string>
#include <vector>

#include "client_runtime/text/tokenizer.h"

namespace symbiosis {

class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = true);
  // The text that `id` completes ("" while a character is incomplete, or for a skipped special token).
  std::string push(int64_t id);
  // The text still held back (an incomplete character's U+FFFD at the end of the stream); starts afresh.
  std::string finish();

 private:
  std::string decode_from_prefix(size_t end) const;

  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  // The window: ids_[0, read_offset_) were given back already; ids_[0, ...) are the context of what follows.
  std::vector<int64_t> ids_;
  size_t read_offset_ = 0;
};

}  // namespace symbiosis
