#include "client_runtime/text/tokenizer.h"

#include <c10/util/Exception.h>

#include "client_runtime/text/sentencepiece_model.h"
#include "client_runtime/text/tokenizer_json.h"

namespace symbiosis {

std::unique_ptr<Tokenizer> Tokenizer::from_directory(const std::filesystem::path& dir) {
  TORCH_CHECK(std::filesystem::is_directory(dir), "tokenizer: ", dir.string(), " is not a directory");
  const auto json_file = dir / "tokenizer.json";
  const auto model_file = dir / "tokenizer.model";
  const auto config = text::read_tokenizer_config(dir / "tokenizer_config.json");
  const bool has_model = std::filesystem::exists(model_file);
  if (std::filesystem::exists(json_file)) {
    try {
      return text::open_tokenizer_json(json_file, config);
    } catch (const c10::NotImplementedError&) {
      // A part of tokenizer.json not implemented here: the SentencePiece model beside it is the same tokenizer.
      if (!has_model) throw;
    }
  }
  if (has_model) return text::open_sentencepiece_model(model_file, config);
  TORCH_CHECK(false, "tokenizer: no tokenizer in ", dir.string(),
              ": looked for tokenizer.json (Hugging Face tokenizers) and tokenizer.model (SentencePiece)");
}

std::unique_ptr<Tokenizer> Tokenizer::in_directory(const std::filesystem::path& dir) {
  if (!std::filesystem::exists(dir / "tokenizer.json") && !std::filesystem::exists(dir / "tokenizer.model")) {
    return nullptr;
  }
  return from_directory(dir);
}

}  // namespace symbiosis
