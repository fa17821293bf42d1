#pragma once
// Internal to text/: what the tokenizers need of Unicode. UTF-8 checks and lossy decoding (as Rust's
// String::from_utf8_lossy and Python's errors="replace" do it), the normalization forms (utf8proc), and
// regular expressions with Unicode properties (\p{L}, \p{N}) run as the tokenizers' Oniguruma runs them (PCRE2
// with UTF and UCP). No LibTorch here.
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace symbiosis::text {

// The byte offset of the first byte that does not start a valid UTF-8 sequence, or nullopt when `s` is valid.
std::optional<size_t> invalid_utf8_offset(std::string_view s);
// `bytes` as valid UTF-8: every maximal invalid subpart replaced by U+FFFD (the Unicode standard's
// "substitution of maximal subparts", which Rust and Python follow).
std::string utf8_lossy(std::string_view bytes);
// Appends the UTF-8 encoding of `code_point`.
void append_utf8(std::string& out, char32_t code_point);
// The code point starting at byte `pos` of valid UTF-8 `s`; advances `pos` past it.
char32_t next_code_point(std::string_view s, size_t& pos);
// The number of bytes of the UTF-8 sequence whose first byte is `lead` (1 for a stray byte).
size_t utf8_length(unsigned char lead);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// `s` (valid UTF-8) in the normal form.
std::string normalize(std::string_view s, NormalForm form);
// `s` (valid UTF-8) lower-cased code point by code point, as the tokenizers' Lowercase normalizer does ([Full lowercase]
// in unicode.cpp: İ becomes "i" and U+0307).
std::string lowercase(std::string_view s);

// A compiled regular expression over UTF-8 text with Unicode properties; safe to share between threads.
class UnicodeRegex {
 public:
  // Throws naming the pattern, the offset and PCRE2's message when the pattern does not compile.
  explicit UnicodeRegex(const std::string& pattern);
  ~UnicodeRegex();
  UnicodeRegex(const UnicodeRegex&) = delete;
  UnicodeRegex& operator=(const UnicodeRegex&) = delete;
  // The [begin, end) byte ranges of the successive non-overlapping matches in `s` (valid UTF-8), left to right.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string pattern_;
};

}  // namespace symbiosis::text
