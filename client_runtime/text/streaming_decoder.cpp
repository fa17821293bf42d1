#include "client_runtime/text/streaming_decoder.h"

#include <cctype>

namespace symbiosis {
namespace {

bool ends_with_replacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

// A byte-fallback token: "<0x" two hexadecimal digits ">".
bool is_byte_token(const std::optional<std::string>& token) {
  return token && token->size() == 6 && token->compare(0, 3, "<0x") == 0 && (*token)[5] == '>' &&
         std::isxdigit(static_cast<unsigned char>((*token)[3])) &&
         std::isxdigit(static_cast<unsigned char>((*token)[4]));
}

}  // namespace

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamingDecoder::decode_from_prefix(size_t end) const {
  return tokenizer_.decode(std::vector<int64_t>(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(end)),
                           skip_special_tokens_);
}

// [Streaming decode]
std::string StreamingDecoder::push(int64_t id) {
  ids_.push_back(id);
  // A skipped special token does not end a run of byte tokens either: decode drops it before the run is read.
  if (is_byte_token(tokenizer_.id_to_token(id)) || (skip_special_tokens_ && tokenizer_.is_special(id))) return "";
  const std::string given = decode_from_prefix(read_offset_);
  const std::string now = decode_from_prefix(ids_.size());
  if (now.size() <= given.size() || ends_with_replacement(now) || now.compare(0, given.size(), given) != 0) return "";
  // The ids given back now become the window's context; the earlier ones are no longer needed.
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(read_offset_));
  read_offset_ = ids_.size();
  return now.substr(given.size());
}

std::string StreamingDecoder::finish() {
  const std::string given = decode_from_prefix(read_offset_);
  const std::string now = decode_from_prefix(ids_.size());
  ids_.clear();
  read_offset_ = 0;
  if (now.size() <= given.size() || now.compare(0, given.size(), given) != 0) return "";
  return now.substr(given.size());
}

}  // namespace symbiosis
