#pragma once
// The checkpoint's tokenizer: text to token ids and back, as Hugging Face transformers tokenizes for the
// same checkpoint. Found in the checkpoint's directory as transformers finds it (from_directory):
//  - tokenizer.json (Hugging Face tokenizers' file; GPT-2, Llama 3, Qwen2, StarCoder and other byte-level BPE
//    tokenizers, and Llama 2's and Gemma's, whose class's pipeline transformers builds itself), implemented here
//    (tokenizer_json.h);
//  - else tokenizer.model (SentencePiece: Llama 2, Mistral, Gemma), converted as transformers converts a
//    LlamaTokenizer's or GemmaTokenizer's and run as a tokenizer.json ([SentencePiece conversion] in
//    sentencepiece_model.h; other classes are refused).
// A Tokenizer is immutable once made: its methods may be called from several threads at once.
// Errors (a missing or malformed file, ids out of range, text that is not UTF-8) throw c10::Error naming the file,
// the field or the value.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace symbiosis {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Finds the tokenizer in a checkpoint directory as transformers does (tokenizer.json preferred, else
  // tokenizer.model; tokenizer_config.json for add_bos/eos and special tokens); throws naming the directory and
  // the files looked for. A tokenizer.json with a part not implemented here gives way to a tokenizer.model
  // beside it (Llama 2's and Gemma's checkpoints carry both); alone, it is refused naming the part.
  static std::unique_ptr<Tokenizer> from_directory(const std::filesystem::path& dir);
  // from_directory, or null when the directory holds neither tokenizer.json nor tokenizer.model (a
  // checkpoint without a tokenizer; the tools then take token ids only).
  static std::unique_ptr<Tokenizer> in_directory(const std::filesystem::path& dir);
  // `text` (UTF-8) as token ids. add_special_tokens: what transformers' tokenizer(text) adds (BOS for Llama,
  // none for GPT-2). Special tokens written in the text ("<|endoftext|>") become their ids, as in transformers.
  virtual std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const = 0;
  // The text of `ids` (invalid UTF-8, such as half a character, comes out as U+FFFD); special tokens as their
  // text unless skipped. Throws naming a negative id; an id without a token (a model's vocabulary padded past the
  // tokenizer's) gives nothing, as in tokenizers.
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const = 0;
  virtual std::optional<int64_t> bos_token_id() const = 0;
  virtual std::optional<int64_t> eos_token_id() const = 0;
  // The number of ids: the model's vocabulary and the added tokens (transformers' len(tokenizer)).
  virtual int64_t vocab_size() const = 0;
  // The id of a token given by its text ("<|eot_id|>", "</s>"), or nullopt when the vocabulary lacks it.
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;
  // The token's text as the vocabulary writes it ("Ġworld", "▁world", "<0x0A>"), or nullopt for an id without one.
  virtual std::optional<std::string> id_to_token(int64_t id) const = 0;
  // Whether `id` is a special token (what decode(..., skip_special_tokens = true) leaves out).
  virtual bool is_special(int64_t id) const = 0;
};

}  // namespace symbiosis
