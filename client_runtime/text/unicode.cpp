#include "client_runtime/text/unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <c10/util/Exception.h>

#include <cstdlib>

namespace symbiosis::text {
namespace {

// The valid range of the second byte of a sequence led by `lead` (the Unicode standard's table 3-7), or
// {1, 0} (an empty range) when `lead` starts no valid sequence.
std::pair<unsigned char, unsigned char> second_byte_range(unsigned char lead) {
  if (lead >= 0xC2 && lead <= 0xDF) return {0x80, 0xBF};
  if (lead == 0xE0) return {0xA0, 0xBF};
  if (lead >= 0xE1 && lead <= 0xEC) return {0x80, 0xBF};
  if (lead == 0xED) return {0x80, 0x9F};
  if (lead >= 0xEE && lead <= 0xEF) return {0x80, 0xBF};
  if (lead == 0xF0) return {0x90, 0xBF};
  if (lead >= 0xF1 && lead <= 0xF3) return {0x80, 0xBF};
  if (lead == 0xF4) return {0x80, 0x8F};
  return {1, 0};
}

// The length of the valid sequence at `pos`, or 0 with `consumed` set to the maximal invalid subpart there.
size_t valid_sequence_at(std::string_view s, size_t pos, size_t& consumed) {
  const auto lead = static_cast<unsigned char>(s[pos]);
  if (lead < 0x80) return 1;
  const auto [low, high] = second_byte_range(lead);
  const size_t length = utf8_length(lead);
  consumed = 1;
  if (low > high) return 0;
  for (size_t k = 1; k < length; ++k) {
    if (pos + k >= s.size()) return 0;
    const auto byte = static_cast<unsigned char>(s[pos + k]);
    const bool ok = k == 1 ? (byte >= low && byte <= high) : (byte >= 0x80 && byte <= 0xBF);
    if (!ok) return 0;
    consumed = k + 1;
  }
  return length;
}

}  // namespace

size_t utf8_length(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return lead < 0xF8 ? 4 : 1;
}

std::optional<size_t> invalid_utf8_offset(std::string_view s) {
  for (size_t pos = 0, consumed = 0; pos < s.size();) {
    const size_t length = valid_sequence_at(s, pos, consumed);
    if (length == 0) return pos;
    pos += length;
  }
  return std::nullopt;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t pos = 0, consumed = 0; pos < bytes.size();) {
    const size_t length = valid_sequence_at(bytes, pos, consumed);
    if (length > 0) {
      out.append(bytes.substr(pos, length));
      pos += length;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
      pos += consumed;
    }
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

char32_t next_code_point(std::string_view s, size_t& pos) {
  const auto lead = static_cast<unsigned char>(s[pos]);
  const size_t length = utf8_length(lead);
  char32_t c = length == 1 ? lead : lead & (0x7F >> length);
  for (size_t k = 1; k < length && pos + k < s.size(); ++k)
    c = (c << 6) | (static_cast<unsigned char>(s[pos + k]) & 0x3F);
  pos += length;
  return c;
}

namespace {

// [Normalization's Unicode] The tokenizers' normalizers (the unicode-normalization-alignments crate) know none
// of the decompositions added since Unicode 12; utf8proc knows Unicode 15's. Those code points are left as
// they are, as the tokenizers leave them, and so is U+11930, which Unicode 13 lets compose with U+11935 into U+11938
// (found by comparing every code point with the tokenizers package). All are starters that compose with nothing
// else, so the text between them is normalized on its own.
bool decomposed_since_unicode_12(char32_t c) {
  return c == 0x32FF || (c >= 0xA7F2 && c <= 0xA7F4) || c == 0xAB69 ||
         (c >= 0x10781 && c <= 0x107BA && c != 0x10786 && c != 0x107B1) || c == 0x11930 || c == 0x11938 ||
         (c >= 0x1E030 && c <= 0x1E06D) || c == 0x1F16C || (c >= 0x1FBF0 && c <= 0x1FBF9);
}

std::string normalize_run(std::string_view s, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::kNfd: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                   &result, static_cast<utf8proc_option_t>(options));
  TORCH_CHECK(length >= 0, "tokenizer: Unicode normalization failed: ", utf8proc_errmsg(length));
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(length));
  std::free(result);
  return out;
}

}  // namespace

std::string normalize(std::string_view s, NormalForm form) {
  std::string out;
  size_t done = 0;
  for (size_t pos = 0; pos < s.size();) {
    const size_t begin = pos;
    if (!decomposed_since_unicode_12(next_code_point(s, pos))) continue;
    out += normalize_run(s.substr(done, begin - done), form);
    out.append(s.substr(begin, pos - begin));
    done = pos;
  }
  return out + normalize_run(s.substr(done), form);
}

namespace {

// [Full lowercase] The tokenizers' Lowercase (and BertNormalizer's lowercase) is Rust's char::to_lowercase, code
// point by code point: Unicode's full lower-case mapping without context. It differs from utf8proc's simple mapping
// in one code point, U+0130 (İ), which SpecialCasing.txt lowers to two, "i" and U+0307 (combining dot above); final
// sigma, being conditional, is not applied (Σ is always σ). And tokenizers' Rust knows Unicode 17, utf8proc 2.8
// Unicode 15: the upper-case letters given lower-case partners since are mapped here (found by comparing every code
// point with the tokenizers package; tests/reference/tokenizers_reference.py's "lowercase" family holds it).
char32_t lower_case_since_unicode_15(char32_t c) {
  switch (c) {
    case 0x1C89: return 0x1C8A;
    case 0xA7CB: return 0x0264;
    case 0xA7CC: return 0xA7CD;
    case 0xA7CE: return 0xA7CF;
    case 0xA7D2: return 0xA7D3;
    case 0xA7D4: return 0xA7D5;
    case 0xA7DA: return 0xA7DB;
    case 0xA7DC: return 0x019B;
    default: break;
  }
  if (c >= 0x10D50 && c <= 0x10D65) return c + 0x20;  // Garay
  if (c >= 0x16EA0 && c <= 0x16EB8) return c + 0x1B;  // Beria Erfe
  return c;
}

}  // namespace

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const char32_t c = next_code_point(s, pos);
    if (c == 0x130) {
      out.append("i\xCC\x87");  // U+0130: "i" and U+0307
      continue;
    }
    const char32_t newer = lower_case_since_unicode_15(c);
    append_utf8(out, newer != c ? newer : static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
  return out;
}

struct UnicodeRegex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

UnicodeRegex::UnicodeRegex(const std::string& pattern) : code_(std::make_unique<Code>()), pattern_(pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                              &error, &offset, nullptr);
  if (code_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    TORCH_CHECK(false, "tokenizer: the regular expression '", pattern, "' does not compile at offset ", offset, ": ",
                reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);  // faster where JIT is available; interpreted otherwise
}

UnicodeRegex::~UnicodeRegex() = default;

std::vector<std::pair<size_t, size_t>> UnicodeRegex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> matches;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code_->code, nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t start = 0;
  while (start <= s.size()) {
    // The text was checked to be UTF-8 once, where encode() took it.
    const int rc = pcre2_match(code_->code, subject, s.size(), start, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    TORCH_CHECK(rc >= 0, "tokenizer: matching the regular expression '", pattern_, "' failed (PCRE2 error ", rc, ")");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {
      // An empty match: skip one character, as Oniguruma's iteration does.
      if (begin >= s.size()) break;
      start = begin + utf8_length(static_cast<unsigned char>(s[begin]));
      continue;
    }
    matches.emplace_back(begin, end);
    start = end;
  }
  return matches;
}

}  // namespace symbiosis::text
