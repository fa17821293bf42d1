#include "client_runtime/text/tokenizer_json.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "client_runtime/text/bpe.h"
#include "client_runtime/text/unicode.h"

namespace symbiosis::text {
namespace {

using nlohmann::json;

// ---- JSON fields, with errors that name the file and the field ----

const json& field(const json& object, const char* name, const std::string& where) {
  TORCH_CHECK(object.is_object(), where, " should be an object, got ", object.dump());
  const auto it = object.find(name);
  TORCH_CHECK(it != object.end(), where, ": missing field '", name, "'");
  return *it;
}

std::string string_field(const json& object, const char* name, const std::string& where) {
  const json& value = field(object, name, where);
  TORCH_CHECK(value.is_string(), where, ".", name, " should be a string, got ", value.dump());
  return value.get<std::string>();
}

bool bool_field(const json& object, const char* name, const std::string& where, bool fallback) {
  if (!object.is_object() || !object.contains(name) || object[name].is_null()) return fallback;
  TORCH_CHECK(object[name].is_boolean(), where, ".", name, " should be true or false, got ", object[name].dump());
  return object[name].get<bool>();
}

int64_t int_field(const json& object, const char* name, const std::string& where) {
  const json& value = field(object, name, where);
  TORCH_CHECK(value.is_number_integer(), where, ".", name, " should be a whole number, got ", value.dump());
  return value.get<int64_t>();
}

const json& array_field(const json& object, const char* name, const std::string& where) {
  const json& value = field(object, name, where);
  TORCH_CHECK(value.is_array(), where, ".", name, " should be an array, got ", value.dump());
  return value;
}

// A "Sequence" part's steps (its `name` array), each read by `read`, which leaves a step out by
// returning null.
template <typename Part, typename Read>
std::vector<std::unique_ptr<Part>> read_steps(const json& object, const char* name, const std::string& where,
                                              Read read) {
  std::vector<std::unique_ptr<Part>> steps;
  const json& list = array_field(object, name, where);
  for (size_t i = 0; i < list.size(); ++i) {
    if (auto step = read(list[i], where + "." + name + "[" + std::to_string(i) + "]")) steps.push_back(std::move(step));
  }
  return steps;
}

// A Split's or Replace's pattern: {"String": "..."} or {"Regex": "..."}; a string becomes an escaped regex.
std::shared_ptr<UnicodeRegex> read_pattern(const json& object, const std::string& where) {
  const json& pattern = field(object, "pattern", where);
  const auto compiled = [&](const std::string& regex) {
    try {
      return std::make_shared<UnicodeRegex>(regex);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, where, ".pattern: ", e.what_without_backtrace());
    }
  };
  if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
    return compiled(pattern["Regex"].get<std::string>());
  }
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
    return compiled("\\Q" + pattern["String"].get<std::string>() + "\\E");
  }
  TORCH_CHECK(false, where, ".pattern should be {\"String\": ...} or {\"Regex\": ...}, got ", pattern.dump());
}

std::string type_of(const json& object, const std::string& where) { return string_field(object, "type", where); }

// ---- The byte-level alphabet: GPT-2's bytes_to_unicode ----

// [Byte-level alphabet] Every byte is a printable character: the printable Latin-1 bytes stand for themselves,
// the other 68 for U+0100 onwards in byte order (so a space is "Ġ", a newline "Ċ").
struct ByteLevelAlphabet {
  std::array<std::string, 256> text_of_byte;
  std::unordered_map<char32_t, unsigned char> byte_of_char;
  ByteLevelAlphabet() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : next++;
      append_utf8(text_of_byte[static_cast<size_t>(b)], c);
      byte_of_char[c] = static_cast<unsigned char>(b);
    }
  }
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// GPT-2's pre-tokenizer regex (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- Normalizers: text to text ----

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string text) const = 0;
};

class UnicodeFormNormalizer : public Normalizer {
 public:
  explicit UnicodeFormNormalizer(NormalForm form) : form_(form) {}
  std::string apply(std::string text) const override { return normalize(text, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  std::string apply(std::string text) const override { return lowercase(text); }
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string apply(std::string text) const override { return text.empty() ? text : prefix_ + text; }

 private:
  std::string prefix_;
};

// Replaces every match of a pattern (the Replace normalizer and decoder).
class Replacement {
 public:
  Replacement(const json& object, const std::string& where)
      : pattern_(read_pattern(object, where)), content_(string_field(object, "content", where)) {}
  std::string apply(const std::string& text) const {
    std::string out;
    size_t done = 0;
    for (const auto& [begin, end] : pattern_->find_all(text)) {
      out.append(text, done, begin - done).append(content_);
      done = end;
    }
    return out.append(text, done);
  }

 private:
  std::shared_ptr<UnicodeRegex> pattern_;
  std::string content_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(const json& object, const std::string& where) : replacement_(object, where) {}
  std::string apply(std::string text) const override { return replacement_.apply(text); }

 private:
  Replacement replacement_;
};

// A "Sequence": its steps applied in order to what a Part applies to (Normalizer: the text;
// Decoder: the tokens).
template <typename Part, typename Value>
class Sequence : public Part {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Part>> steps) : steps_(std::move(steps)) {}
  Value apply(Value value) const override {
    for (const auto& step : steps_) value = step->apply(std::move(value));
    return value;
  }

 private:
  std::vector<std::unique_ptr<Part>> steps_;
};

using SequenceNormalizer = Sequence<Normalizer, std::string>;

std::unique_ptr<Normalizer> read_normalizer(const json& object, const std::string& where) {
  if (object.is_null()) return nullptr;
  const std::string type = type_of(object, where);
  if (type == "NFC") return std::make_unique<UnicodeFormNormalizer>(NormalForm::kNfc);
  if (type == "NFD") return std::make_unique<UnicodeFormNormalizer>(NormalForm::kNfd);
  if (type == "NFKC") return std::make_unique<UnicodeFormNormalizer>(NormalForm::kNfkc);
  if (type == "NFKD") return std::make_unique<UnicodeFormNormalizer>(NormalForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(string_field(object, "prepend", where));
  if (type == "Replace") return std::make_unique<ReplaceNormalizer>(object, where);
  if (type == "Sequence") {
    return std::make_unique<SequenceNormalizer>(read_steps<Normalizer>(object, "normalizers", where, read_normalizer));
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, where, ": the normalizer type '", type,
                              "' is not supported (NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Sequence are)");
}

// ---- Pre-tokenizers: pieces of text to smaller pieces ----

struct Piece {
  std::string text;
  bool at_text_start;  // begins where the whole text begins (Metaspace's prepend_scheme "first")
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// The pieces of `piece` around the pattern's matches, kept as tokenizers' split with `behavior` keeps them.
void split_piece(const Piece& piece, const UnicodeRegex& pattern, SplitBehavior behavior, bool invert,
                 std::vector<Piece>& out) {
  struct Part {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t done = 0;
  for (const auto& [begin, end] : pattern.find_all(piece.text)) {
    if (begin > done) parts.push_back({done, begin, invert});
    parts.push_back({begin, end, !invert});
    done = end;
  }
  if (done < piece.text.size() || parts.empty()) parts.push_back({done, piece.text.size(), invert});
  std::vector<Part> kept;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Part& part : parts) {
        if (!part.is_match) kept.push_back(part);
      }
      break;
    case SplitBehavior::kIsolated: kept = parts; break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Part& part : parts) {
        if (part.is_match && !previous_match && !kept.empty()) {
          kept.back().end = part.end;
        } else {
          kept.push_back(part);
        }
        previous_match = part.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty()) {
          kept.back().begin = it->begin;
        } else {
          kept.push_back(*it);
        }
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kContiguous:
      for (size_t i = 0; i < parts.size(); ++i) {
        if (i > 0 && parts[i].is_match == previous_match) {
          kept.back().end = parts[i].end;
        } else {
          kept.push_back(parts[i]);
        }
        previous_match = parts[i].is_match;
      }
      break;
  }
  for (const Part& part : kept) {
    if (part.end > part.begin) {
      out.push_back({piece.text.substr(part.begin, part.end - part.begin), piece.at_text_start && part.begin == 0});
    }
  }
}

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual std::vector<Piece> apply(std::vector<Piece> pieces) const = 0;
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(std::shared_ptr<UnicodeRegex> pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  std::vector<Piece> apply(std::vector<Piece> pieces) const override {
    std::vector<Piece> out;
    for (const Piece& piece : pieces) split_piece(piece, *pattern_, behavior_, invert_, out);
    return out;
  }

 private:
  std::shared_ptr<UnicodeRegex> pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space),
        regex_(use_regex ? std::make_unique<UnicodeRegex>(kGpt2Pattern) : nullptr) {}
  std::vector<Piece> apply(std::vector<Piece> pieces) const override {
    std::vector<Piece> split;
    for (Piece& piece : pieces) {
      if (add_prefix_space_ && (piece.text.empty() || piece.text[0] != ' ')) piece.text.insert(0, " ");
      if (regex_) {
        split_piece(piece, *regex_, SplitBehavior::kIsolated, false, split);
      } else {
        split.push_back(std::move(piece));
      }
    }
    const auto& alphabet = byte_level_alphabet();
    for (Piece& piece : split) {
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      for (const char byte : piece.text) mapped += alphabet.text_of_byte[static_cast<unsigned char>(byte)];
      piece.text = std::move(mapped);
    }
    return split;
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<UnicodeRegex> regex_;
};

// Metaspace: spaces become the replacement ("▁"), which is put before the text as prepend_scheme says; with split,
// each word begins at a replacement.
class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, std::string prepend_scheme, bool split)
      : replacement_(std::move(replacement)),
        prepend_scheme_(std::move(prepend_scheme)),
        splitter_(split ? std::make_unique<UnicodeRegex>("\\Q" + replacement_ + "\\E") : nullptr) {}
  std::vector<Piece> apply(std::vector<Piece> pieces) const override {
    std::vector<Piece> out;
    for (Piece& piece : pieces) {
      std::string text;
      for (const char c : piece.text) c == ' ' ? text.append(replacement_) : text.append(1, c);
      const bool prepend = prepend_scheme_ == "always" || (prepend_scheme_ == "first" && piece.at_text_start);
      if (prepend && text.compare(0, replacement_.size(), replacement_) != 0) text.insert(0, replacement_);
      Piece replaced{std::move(text), piece.at_text_start};
      if (splitter_) {
        split_piece(replaced, *splitter_, SplitBehavior::kMergedWithNext, false, out);
      } else {
        out.push_back(std::move(replaced));
      }
    }
    return out;
  }

 private:
  std::string replacement_, prepend_scheme_;
  std::unique_ptr<UnicodeRegex> splitter_;
};

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  std::vector<Piece> apply(std::vector<Piece> pieces) const override {
    for (const auto& step : steps_) pieces = step->apply(std::move(pieces));
    return pieces;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

SplitBehavior read_behavior(const json& object, const std::string& where) {
  const std::string behavior = string_field(object, "behavior", where);
  if (behavior == "Removed") return SplitBehavior::kRemoved;
  if (behavior == "Isolated") return SplitBehavior::kIsolated;
  if (behavior == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (behavior == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (behavior == "Contiguous") return SplitBehavior::kContiguous;
  TORCH_CHECK(false, where, ".behavior '", behavior,
              "' is none of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

std::unique_ptr<PreTokenizer> read_pre_tokenizer(const json& object, const std::string& where) {
  if (object.is_null()) return nullptr;
  const std::string type = type_of(object, where);
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(bool_field(object, "add_prefix_space", where, true),
                                                   bool_field(object, "use_regex", where, true));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(read_pattern(object, where), read_behavior(object, where),
                                               bool_field(object, "invert", where, false));
  }
  if (type == "Digits") {
    // Rust's char::is_numeric is Unicode's N categories, as \p{N}.
    const bool individual = bool_field(object, "individual_digits", where, false);
    return std::make_unique<SplitPreTokenizer>(std::make_shared<UnicodeRegex>(individual ? "\\p{N}" : "\\p{N}+"),
                                               SplitBehavior::kIsolated, false);
  }
  if (type == "Metaspace") {
    std::string scheme = "always";
    if (object.contains("prepend_scheme")) {
      scheme = string_field(object, "prepend_scheme", where);
    } else if (!bool_field(object, "add_prefix_space", where, true)) {
      scheme = "never";
    }
    TORCH_CHECK(scheme == "always" || scheme == "first" || scheme == "never", where, ".prepend_scheme '", scheme,
                "' is none of always, first, never");
    return std::make_unique<MetaspacePreTokenizer>(string_field(object, "replacement", where), scheme,
                                                   bool_field(object, "split", where, true));
  }
  if (type == "Sequence") {
    return std::make_unique<SequencePreTokenizer>(
        read_steps<PreTokenizer>(object, "pretokenizers", where, read_pre_tokenizer));
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, where, ": the pre-tokenizer type '", type,
                              "' is not supported (ByteLevel, Split, Digits, Metaspace, Sequence are)");
}

// ---- Post-processors: the ids of the text to the ids with special tokens ----

// The ids the template puts around the text's (TemplateProcessing's "single"; ByteLevel adds none).
struct PostProcessor {
  std::vector<int64_t> before, after;
};

void read_post_processor(const json& object, const std::string& where, PostProcessor& out) {
  if (object.is_null()) return;
  const std::string type = type_of(object, where);
  if (type == "ByteLevel") return;  // it trims offsets, which encode() does not give
  if (type == "Sequence") {
    const json& list = array_field(object, "processors", where);
    for (size_t i = 0; i < list.size(); ++i) {
      read_post_processor(list[i], where + ".processors[" + std::to_string(i) + "]", out);
    }
    return;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(type == "TemplateProcessing", where, ": the post-processor type '", type,
                              "' is not supported (ByteLevel, TemplateProcessing, Sequence are)");
  const json& single = array_field(object, "single", where);
  const json& special_tokens = field(object, "special_tokens", where);
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item = where + ".single[" + std::to_string(i) + "]";
    if (single[i].contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const std::string name = string_field(field(single[i], "SpecialToken", item), "id", item + ".SpecialToken");
    const std::string entry = where + ".special_tokens[\"" + name + "\"]";
    const json& ids = array_field(field(special_tokens, name.c_str(), where + ".special_tokens"), "ids", entry);
    for (const json& id : ids) {
      TORCH_CHECK(id.is_number_integer(), entry, ".ids should hold whole numbers, got ", id.dump());
      (seen_sequence ? out.after : out.before).push_back(id.get<int64_t>());
    }
  }
}

// ---- Decoders: tokens to text ----

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<std::string> apply(std::vector<std::string> tokens) const = 0;
};

class ByteLevelDecoder : public Decoder {
 public:
  // Tokens of the byte-level alphabet become their bytes, others (added tokens outside it) stay as they are;
  // the bytes together are one text, invalid UTF-8 replaced.
  std::vector<std::string> apply(std::vector<std::string> tokens) const override {
    const auto& alphabet = byte_level_alphabet();
    std::string bytes;
    for (const std::string& token : tokens) {
      std::string mapped;
      bool all_mapped = true;
      for (size_t pos = 0; pos < token.size() && all_mapped;) {
        const auto it = alphabet.byte_of_char.find(next_code_point(token, pos));
        all_mapped = it != alphabet.byte_of_char.end();
        if (all_mapped) mapped += static_cast<char>(it->second);
      }
      bytes += all_mapped ? mapped : token;
    }
    return {utf8_lossy(bytes)};
  }
};

// <0xAB> tokens become their bytes: each run of them one text, or U+FFFD per byte when the run is not UTF-8.
class ByteFallbackDecoder : public Decoder {
 public:
  std::vector<std::string> apply(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    std::string run;
    size_t run_length = 0;
    const auto flush = [&] {
      if (run_length == 0) return;
      if (invalid_utf8_offset(run)) {
        for (size_t i = 0; i < run_length; ++i) out.emplace_back("\xEF\xBF\xBD");
      } else {
        out.push_back(run);
      }
      run.clear();
      run_length = 0;
    };
    for (std::string& token : tokens) {
      unsigned value = 0;
      if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>' &&
          std::sscanf(token.c_str() + 3, "%2x", &value) == 1) {
        run += static_cast<char>(value);
        ++run_length;
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    return out;
  }
};

class FuseDecoder : public Decoder {
 public:
  std::vector<std::string> apply(std::vector<std::string> tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined += token;
    return {joined};
  }
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(const json& object, const std::string& where) : replacement_(object, where) {}
  std::vector<std::string> apply(std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) token = replacement_.apply(token);
    return tokens;
  }

 private:
  Replacement replacement_;
};

// Strips up to `start` leading and `stop` trailing copies of one character from each token.
class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, int64_t start, int64_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  std::vector<std::string> apply(std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) {
      for (int64_t i = 0; i < start_ && token.compare(0, content_.size(), content_) == 0; ++i) {
        token.erase(0, content_.size());
      }
      for (int64_t i = 0; i < stop_ && token.size() >= content_.size() &&
                          token.compare(token.size() - content_.size(), content_.size(), content_) == 0;
           ++i) {
        token.erase(token.size() - content_.size());
      }
    }
    return tokens;
  }

 private:
  std::string content_;
  int64_t start_, stop_;
};

// The replacement ("▁") back to spaces; the first token's leading space dropped unless prepend_scheme is never.
class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  std::vector<std::string> apply(std::vector<std::string> tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& token = tokens[i];
      for (size_t pos = 0; pos < token.size();) {
        if (token.compare(pos, replacement_.size(), replacement_) == 0) {
          if (!(i == 0 && pos == 0 && strip_first_)) out += ' ';
          pos += replacement_.size();
        } else {
          out += token[pos++];
        }
      }
      tokens[i] = std::move(out);
    }
    return tokens;
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

using SequenceDecoder = Sequence<Decoder, std::vector<std::string>>;

std::unique_ptr<Decoder> read_decoder(const json& object, const std::string& where) {
  if (object.is_null()) return nullptr;
  const std::string type = type_of(object, where);
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Replace") return std::make_unique<ReplaceDecoder>(object, where);
  if (type == "Strip") {
    return std::make_unique<StripDecoder>(string_field(object, "content", where), int_field(object, "start", where),
                                          int_field(object, "stop", where));
  }
  if (type == "Metaspace") {
    std::string scheme = "always";
    if (object.contains("prepend_scheme"))
      scheme = string_field(object, "prepend_scheme", where);
    else if (!bool_field(object, "add_prefix_space", where, true))
      scheme = "never";
    return std::make_unique<MetaspaceDecoder>(string_field(object, "replacement", where), scheme != "never");
  }
  if (type == "Sequence") {
    return std::make_unique<SequenceDecoder>(read_steps<Decoder>(object, "decoders", where, read_decoder));
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, where, ": the decoder type '", type,
      "' is not supported (ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace, Sequence are)");
}

// ---- Added tokens ----

struct AddedToken {
  int64_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

bool is_word_character(char32_t c) {
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (category >= UTF8PROC_CATEGORY_LU && category <= UTF8PROC_CATEGORY_LO) ||
         (category >= UTF8PROC_CATEGORY_ND && category <= UTF8PROC_CATEGORY_NO);
}

bool is_white_space(char32_t c) {
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (c >= 0x09 && c <= 0x0D) || c == 0x85 || category == UTF8PROC_CATEGORY_ZS ||
         category == UTF8PROC_CATEGORY_ZL || category == UTF8PROC_CATEGORY_ZP;
}

// The last code point before byte `end` of valid UTF-8 `s`, and where it starts.
char32_t code_point_before(std::string_view s, size_t end, size_t& begin) {
  begin = end - 1;
  while (begin > 0 && (static_cast<unsigned char>(s[begin]) & 0xC0) == 0x80) --begin;
  size_t pos = begin;
  return next_code_point(s, pos);
}

// Finds added tokens in text, leftmost first and longest at a position, as tokenizers' Aho-Corasick
// (LeftmostLongest) does, with each token's single_word, lstrip and rstrip.
class AddedTokenSplitter {
 public:
  void add(const AddedToken* token) {
    if (token->content.empty()) return;
    auto& list = by_first_byte_[static_cast<unsigned char>(token->content[0])];
    list.push_back(token);
    std::stable_sort(list.begin(), list.end(),
                     [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
  }
  bool empty() const {
    for (const auto& list : by_first_byte_) {
      if (!list.empty()) return false;
    }
    return true;
  }
  // Calls text(begin, end) for the text between tokens and token(id) for each token, in order.
  template <typename OnText, typename OnToken>
  void split(std::string_view s, OnText&& text, OnToken&& token) const {
    size_t done = 0;
    for (size_t pos = 0; pos < s.size();) {
      const AddedToken* found = match_at(s, pos);
      if (found == nullptr) {
        ++pos;
        continue;
      }
      size_t begin = pos, end = pos + found->content.size();
      if (found->lstrip) {
        for (size_t before = 0; begin > done && is_white_space(code_point_before(s, begin, before));) begin = before;
      }
      if (found->rstrip) {
        for (size_t next = end; next < s.size() && is_white_space(next_code_point(s, next));) end = next;
      }
      if (begin > done) text(done, begin);
      token(found->id);
      done = end;
      pos = end;
    }
    if (done < s.size()) text(done, s.size());
  }

 private:
  const AddedToken* match_at(std::string_view s, size_t pos) const {
    for (const AddedToken* token : by_first_byte_[static_cast<unsigned char>(s[pos])]) {
      if (s.compare(pos, token->content.size(), token->content) != 0) continue;
      if (token->single_word) {
        size_t before = 0, after = pos + token->content.size();
        if (pos > 0 && is_word_character(code_point_before(s, pos, before))) continue;
        if (after < s.size() && is_word_character(next_code_point(s, after))) continue;
      }
      return token;
    }
    return nullptr;
  }

  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
};

// ---- The tokenizer ----

class JsonTokenizer : public Tokenizer {
 public:
  JsonTokenizer(const json& file, const std::string& where, const TokenizerConfig& config);

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override;
  std::optional<int64_t> bos_token_id() const override { return bos_; }
  std::optional<int64_t> eos_token_id() const override { return eos_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<int64_t> token_to_id(std::string_view token) const override;
  bool is_special(int64_t id) const override { return special_ids_.count(id) > 0; }
  std::optional<std::string> id_to_token(int64_t id) const override {
    if (const auto added = added_by_id_.find(id); added != added_by_id_.end()) return added->second->content;
    if (const std::string* token = model_->id_to_token(id)) return *token;
    return std::nullopt;
  }

 private:
  void encode_text(std::string_view text, bool at_text_start, std::vector<int64_t>& ids) const;
  // Before added_by_id_ and the splitters are made ([Tokenizer classes]).
  void add_class_special_tokens(const TokenizerConfig& config);

  std::vector<AddedToken> added_tokens_;
  std::unordered_map<int64_t, const AddedToken*> added_by_id_;
  std::unordered_set<int64_t> special_ids_;
  AddedTokenSplitter raw_splitter_, normalized_splitter_;  // tokens matched before and after normalization
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  PostProcessor post_processor_;
  std::unique_ptr<Decoder> decoder_;
  std::optional<int64_t> bos_, eos_;
  int64_t vocab_size_ = 0;
};

// [Tokenizer classes]
// transformers 5 loads a tokenizer.json as written unless tokenizer_config.json names a class that
// builds its pipeline itself (with or without "Fast": one class): it then keeps the file's vocabulary, merges,
// post-processor and added tokens and makes the rest as the class says. Two such classes are built here.
// LlamaTokenizer, what Llama 2 and Mistral checkpoints name:
//   model          BPE with fuse_unk and byte_fallback, no unk_token, none of the file's other options;
//   normalizer     none (the file's Prepend and Replace, if any, are dropped);
//   pre_tokenizer  Metaspace("▁", split false), prepending "▁" to the text's start ("first"), to every
//                  piece between added tokens when `legacy` is true ("always"), or never when
//                  add_prefix_space is false (legacy defaults to false, add_prefix_space to true);
//   decoder        Replace("▁", " "), ByteFallback, Fuse, and Strip(" ", 1 from the left) with the prefix;
//   special tokens <unk>, <s>, </s> unless tokenizer_config.json names others.
// GemmaTokenizer, what every Gemma generation's checkpoints name (legacy and add_prefix_space mean nothing to it):
//   model          BPE with fuse_unk, byte_fallback and unk_token (tokenizer_config.json's, or <unk>);
//   normalizer     Replace(" ", "▁"), so that the text between added tokens is one word to the BPE model;
//   pre_tokenizer  Split(" ", MergedWithPrevious), which the normalizer has left no space to split at;
//   decoder        Replace("▁", " "), ByteFallback, Fuse: no space is stripped;
//   special tokens <bos>, <eos>, <unk>, <pad>, <mask> unless tokenizer_config.json names others.
// Either class makes its special tokens special added tokens, in that order (BOS, EOS, unknown, padding, mask): an
// added token of that text becomes special, a token of the vocabulary becomes an added one, and a token that is
// neither is appended after the vocabulary (a Gemma-class model without <mask> gets one).
// This returns the file as transformers builds it, so that the rest reads it as any other.
constexpr TokenizerClass kClassesBuildingPipelines[] = {
    {TokenizerClass::Pipeline::kLlama, "LlamaTokenizer", "<s>", "</s>", "<unk>", nullptr, nullptr},
    {TokenizerClass::Pipeline::kGemma, "GemmaTokenizer", "<bos>", "<eos>", "<unk>", "<pad>", "<mask>"},
};

json as_transformers_builds(json file, const TokenizerClass& built, const TokenizerConfig& config) {
  if (!file.contains("model") || file["model"].value("type", "BPE") != "BPE") return file;
  const json& model = file["model"];
  json rebuilt = {{"type", "BPE"},
                  {"vocab", model.value("vocab", json::object())},
                  {"merges", model.value("merges", json::array())},
                  {"fuse_unk", true},
                  {"byte_fallback", true}};
  const json replace_replacement = {{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}};
  json decoders = json::array({replace_replacement, {{"type", "ByteFallback"}}, {{"type", "Fuse"}}});
  switch (built.pipeline) {
    case TokenizerClass::Pipeline::kLlama: {
      const bool prefix = config.add_prefix_space.value_or(true);
      file["normalizer"] = nullptr;
      const char* scheme = !prefix ? "never" : config.legacy.value_or(false) ? "always" : "first";
      file["pre_tokenizer"] = {
          {"type", "Metaspace"}, {"replacement", "\u2581"}, {"split", false}, {"prepend_scheme", scheme}};
      if (prefix) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
      break;
    }
    case TokenizerClass::Pipeline::kGemma:
      // tokenizers' BPE refuses an unk_token outside the vocabulary only when it needs one; BpeModel refuses it
      // when the file is read, so one the vocabulary lacks is left out (byte fallback leaves nothing unknown).
      if (config.unk_token && rebuilt["vocab"].contains(*config.unk_token)) rebuilt["unk_token"] = *config.unk_token;
      file["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
      file["pre_tokenizer"] = {
          {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"}, {"invert", false}};
      break;
  }
  file["model"] = std::move(rebuilt);
  file["decoder"] = {{"type", "Sequence"}, {"decoders", decoders}};
  return file;
}

JsonTokenizer::JsonTokenizer(const json& written, const std::string& where, const TokenizerConfig& written_config) {
  const TokenizerClass* built = class_building_pipeline(written_config);
  const TokenizerConfig config = built ? with_class_defaults(written_config, *built) : written_config;
  const json file = built ? as_transformers_builds(written, *built, config) : written;
  const json& model = field(file, "model", where);
  const std::string model_type = model.contains("type") ? type_of(model, where + ": model") : "BPE";
  TORCH_CHECK_NOT_IMPLEMENTED(model_type == "BPE", where, ": model.type '", model_type, "' is not supported (BPE is)");
  model_ = std::make_unique<BpeModel>(model, where + ": model");
  if (file.contains("added_tokens") && !file["added_tokens"].is_null()) {
    const json& list = array_field(file, "added_tokens", where);
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string item = where + ": added_tokens[" + std::to_string(i) + "]";
      added_tokens_.push_back({int_field(list[i], "id", item), string_field(list[i], "content", item),
                               bool_field(list[i], "single_word", item, false),
                               bool_field(list[i], "lstrip", item, false), bool_field(list[i], "rstrip", item, false),
                               bool_field(list[i], "normalized", item, true),
                               bool_field(list[i], "special", item, false)});
    }
  }
  // tokenizer_config.json's added tokens that tokenizer.json lacks (transformers adds them the same way).
  for (const auto& added : config.added_tokens) {
    bool known = false;
    for (const AddedToken& token : added_tokens_) known = known || token.id == added.id;
    if (!known) added_tokens_.push_back({added.id, added.content, false, false, false, !added.special, added.special});
  }
  if (built) add_class_special_tokens(config);
  for (const AddedToken& token : added_tokens_) {
    TORCH_CHECK(token.id >= 0, where, ": added token '", token.content, "' has a negative id ", token.id);
    added_by_id_[token.id] = &token;
    if (token.special) special_ids_.insert(token.id);
    // "normalized" tokens are looked for in the normalized text, the others in the text as written.
    (token.normalized ? normalized_splitter_ : raw_splitter_).add(&token);
  }
  normalizer_ = read_normalizer(file.value("normalizer", json()), where + ": normalizer");
  pre_tokenizer_ = read_pre_tokenizer(file.value("pre_tokenizer", json()), where + ": pre_tokenizer");
  read_post_processor(file.value("post_processor", json()), where + ": post_processor", post_processor_);
  decoder_ = read_decoder(file.value("decoder", json()), where + ": decoder");

  std::unordered_set<std::string> tokens;
  for (int64_t id = 0; id < model_->size(); ++id) {
    if (const std::string* token = model_->id_to_token(id)) tokens.insert(*token);
  }
  for (const AddedToken& token : added_tokens_) tokens.insert(token.content);
  vocab_size_ = static_cast<int64_t>(tokens.size());

  const auto named = [&](const std::optional<std::string>& name, const char* field_name) -> std::optional<int64_t> {
    if (!name) return std::nullopt;
    const auto id = token_to_id(*name);
    TORCH_CHECK(id.has_value(), "tokenizer_config.json: ", field_name, " '", *name, "' is not a token of ", where);
    return id;
  };
  bos_ = named(config.bos_token, "bos_token");
  eos_ = named(config.eos_token, "eos_token");
  if (!bos_ && !config.bos_token && !post_processor_.before.empty()) bos_ = post_processor_.before.front();
}

void JsonTokenizer::add_class_special_tokens(const TokenizerConfig& config) {
  // [Tokenizer classes] the class's special tokens are special added tokens, appended after the vocabulary and
  // the added tokens where neither has them (tokenizers' AddedVocabulary gives a new token the next id).
  int64_t next_id = model_->size();
  for (const AddedToken& token : added_tokens_) next_id = std::max(next_id, token.id + 1);
  for (const auto& name : {config.bos_token, config.eos_token, config.unk_token, config.pad_token, config.mask_token}) {
    if (!name) continue;
    const auto added = std::find_if(added_tokens_.begin(), added_tokens_.end(),
                                    [&](const AddedToken& token) { return token.content == *name; });
    if (added != added_tokens_.end()) {
      added->special = true;
      continue;
    }
    const auto id = model_->token_to_id(*name);
    added_tokens_.push_back({id.value_or(next_id), *name, false, false, false, /*normalized=*/false, /*special=*/true});
    if (!id) ++next_id;
  }
}

std::optional<int64_t> JsonTokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& added : added_tokens_) {
    if (added.content == token) return added.id;
  }
  return model_->token_to_id(token);
}

void JsonTokenizer::encode_text(std::string_view text, bool at_text_start, std::vector<int64_t>& ids) const {
  const std::string normalized = normalizer_ ? normalizer_->apply(std::string(text)) : std::string(text);
  normalized_splitter_.split(
      normalized,
      [&](size_t begin, size_t end) {
        std::vector<Piece> pieces{{normalized.substr(begin, end - begin), at_text_start && begin == 0}};
        if (pre_tokenizer_) pieces = pre_tokenizer_->apply(std::move(pieces));
        for (const Piece& piece : pieces) model_->encode_word(piece.text, ids);
      },
      [&](int64_t id) { ids.push_back(id); });
}

std::vector<int64_t> JsonTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const auto invalid = invalid_utf8_offset(text);
  TORCH_CHECK(!invalid, "tokenizer: the text is not UTF-8 (byte ", *invalid, " of ", text.size(), ")");
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = post_processor_.before;
  raw_splitter_.split(
      text, [&](size_t begin, size_t end) { encode_text(text.substr(begin, end - begin), begin == 0, ids); },
      [&](int64_t id) { ids.push_back(id); });
  if (add_special_tokens) ids.insert(ids.end(), post_processor_.after.begin(), post_processor_.after.end());
  return ids;
}

std::string JsonTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    TORCH_CHECK(id >= 0, "tokenizer: cannot decode the negative id ", id);
    if (skip_special_tokens && special_ids_.count(id)) continue;
    if (const auto added = added_by_id_.find(id); added != added_by_id_.end()) {
      tokens.push_back(added->second->content);
    } else if (const std::string* token = model_->id_to_token(id)) {
      tokens.push_back(*token);
    }  // an id with no token (a model's padded vocabulary) decodes to nothing, as in tokenizers
  }
  if (!decoder_) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  std::string text;
  for (const std::string& piece : decoder_->apply(std::move(tokens))) text += piece;
  return text;
}

}  // namespace

const TokenizerClass* class_building_pipeline(const TokenizerConfig& config) {
  if (!config.tokenizer_class) return nullptr;
  for (const TokenizerClass& built : kClassesBuildingPipelines) {
    const std::string& name = *config.tokenizer_class;
    if (name == built.name || name == std::string(built.name) + "Fast") return &built;
  }
  return nullptr;
}

std::string classes_building_pipelines() {
  std::string names;
  for (const TokenizerClass& built : kClassesBuildingPipelines) {
    names += (names.empty() ? "" : ", ") + std::string(built.name);
  }
  return names;
}

TokenizerConfig with_class_defaults(TokenizerConfig config, const TokenizerClass& built) {
  for (const auto& [slot, name] :
       {std::pair{&config.bos_token, built.bos_token}, std::pair{&config.eos_token, built.eos_token},
        std::pair{&config.unk_token, built.unk_token}, std::pair{&config.pad_token, built.pad_token},
        std::pair{&config.mask_token, built.mask_token}}) {
    if (!*slot && name != nullptr) *slot = name;
  }
  return config;
}

namespace {

json read_json(const std::filesystem::path& file) {
  std::ifstream in(file);
  TORCH_CHECK(in, "tokenizer: cannot read ", file.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, file.string(), " is not valid JSON: ", e.what());
  }
}

}  // namespace

TokenizerConfig read_tokenizer_config(const std::filesystem::path& file) {
  TokenizerConfig config;
  if (!std::filesystem::exists(file)) return config;
  const std::string where = file.string();
  const json root = read_json(file);
  TORCH_CHECK(root.is_object(), where, " should hold a JSON object");
  // A token may be written as "text" or as {"content": "text", ...} (an AddedToken).
  const auto token = [&](const char* name) -> std::optional<std::string> {
    if (!root.contains(name) || root[name].is_null()) return std::nullopt;
    const json& value = root[name];
    if (value.is_string()) return value.get<std::string>();
    TORCH_CHECK(value.is_object() && value.contains("content") && value["content"].is_string(), where, ": ", name,
                " should be a string or {\"content\": ...}, got ", value.dump());
    return value["content"].get<std::string>();
  };
  config.bos_token = token("bos_token");
  config.eos_token = token("eos_token");
  config.unk_token = token("unk_token");
  config.pad_token = token("pad_token");
  config.mask_token = token("mask_token");
  if (root.contains("tokenizer_class") && !root["tokenizer_class"].is_null()) {
    TORCH_CHECK(root["tokenizer_class"].is_string(), where, ": tokenizer_class should be a string, got ",
                root["tokenizer_class"].dump());
    config.tokenizer_class = root["tokenizer_class"].get<std::string>();
  }
  for (const auto& [name, slot] :
       {std::pair{"add_bos_token", &config.add_bos_token}, std::pair{"add_eos_token", &config.add_eos_token},
        std::pair{"legacy", &config.legacy}, std::pair{"add_prefix_space", &config.add_prefix_space}}) {
    if (!root.contains(name) || root[name].is_null()) continue;
    TORCH_CHECK(root[name].is_boolean(), where, ": ", name, " should be true or false, got ", root[name].dump());
    *slot = root[name].get<bool>();
  }
  if (root.contains("added_tokens_decoder") && !root["added_tokens_decoder"].is_null()) {
    const json& decoder = root["added_tokens_decoder"];
    TORCH_CHECK(decoder.is_object(), where, ": added_tokens_decoder should be an object of id: token");
    for (const auto& [id, entry] : decoder.items()) {
      const std::string item = where + ": added_tokens_decoder[\"" + id + "\"]";
      int64_t number = -1;
      try {
        size_t used = 0;
        number = std::stoll(id, &used);
        if (used != id.size()) number = -1;
      } catch (const std::exception&) {
      }
      TORCH_CHECK(number >= 0, item, ": the key should be an id (a whole number >= 0)");
      config.added_tokens.push_back(
          {number, string_field(entry, "content", item), bool_field(entry, "special", item, false)});
    }
  }
  return config;
}

std::unique_ptr<Tokenizer> open_tokenizer_json(const std::filesystem::path& file, const TokenizerConfig& config) {
  return std::make_unique<JsonTokenizer>(read_json(file), file.string(), config);
}

std::unique_ptr<Tokenizer> make_tokenizer_json(const json& file, const std::string& where,
                                               const TokenizerConfig& config) {
  return std::make_unique<JsonTokenizer>(file, where, config);
}

}  // namespace symbiosis::text
