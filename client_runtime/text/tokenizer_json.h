#pragma once
// Internal to text/: a tokenizer.json (Hugging Face tokenizers' file) run as the tokenizers library runs it,
// for the BPE tokenizers of causal LMs (GPT-2, Llama 3, Qwen2, StarCoder, and Llama 2's and Gemma's conversions).
// encode: added tokens split out of the text first (leftmost-longest, with their lstrip/rstrip/single_word), the
// rest normalized, pre-tokenized into words, each word merged by the BPE model (bpe.h); then the post-processor's
// template (BOS for Llama 3) when special tokens are asked for. decode: the ids' tokens through the decoder.
// The parts implemented:
//   normalizer     NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Sequence
//   pre_tokenizer  ByteLevel (GPT-2's regex or none), Split (regex or string, every behavior), Digits, Sequence
//   model          BPE (byte_fallback, unk_token, fuse_unk, ignore_merges)
//   post_processor ByteLevel, TemplateProcessing, Sequence
//   decoder        ByteLevel, ByteFallback, Fuse, Replace, Strip, Sequence
// Any other is refused with c10::NotImplementedError naming it (from_directory then tries tokenizer.model).
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>

#include "client_runtime/text/tokenizer.h"

namespace symbiosis::text {

// What tokenizer_config.json adds to the tokenizer files: the names of the special tokens, whether to add BOS
// and EOS (SentencePiece models), added tokens (added_tokens_decoder), and the tokenizer class with the options
// by which transformers builds some classes' pipelines itself ([Tokenizer classes] in tokenizer_json.cpp).
// Fields absent stay unset.
struct TokenizerConfig {
  std::optional<std::string> bos_token, eos_token, unk_token, pad_token, mask_token;
  std::optional<bool> add_bos_token, add_eos_token;
  std::optional<std::string> tokenizer_class;
  std::optional<bool> legacy, add_prefix_space;
  struct AddedToken {
    int64_t id;
    std::string content;
    bool special;
  };
  std::vector<AddedToken> added_tokens;
};
// Reads `file` (absent: an empty config); throws naming the file and the field that is malformed.
TokenizerConfig read_tokenizer_config(const std::filesystem::path& file);

std::unique_ptr<Tokenizer> open_tokenizer_json(const std::filesystem::path& file, const TokenizerConfig& config);
// The tokenizer of a tokenizer.json document (`where` names it in errors), as open_tokenizer_json.
std::unique_ptr<Tokenizer> make_tokenizer_json(const nlohmann::json& file, const std::string& where,
                                               const TokenizerConfig& config);
// A tokenizer class whose pipeline transformers builds itself ([Tokenizer classes] in tokenizer_json.cpp), with
// the names its special tokens take where tokenizer_config.json gives none (nullptr: the class has no such token).
struct TokenizerClass {
  enum class Pipeline { kLlama, kGemma } pipeline;
  const char* name;
  const char *bos_token, *eos_token, *unk_token, *pad_token, *mask_token;
};
// The class that tokenizer_config.json names (with or without "Fast") if transformers builds its pipeline;
// nullptr for any other class, or none.
const TokenizerClass* class_building_pipeline(const TokenizerConfig& config);
// The names of the classes class_building_pipeline knows, for messages ("LlamaTokenizer, GemmaTokenizer").
std::string classes_building_pipelines();
// `config` with the class's special token names where it gives none.
TokenizerConfig with_class_defaults(TokenizerConfig config, const TokenizerClass& built);

}  // namespace symbiosis::text
