#pragma once
// Internal to text/: a tokenizer.model (SentencePiece: Llama 2, Gemma, Mistral) through the SentencePiece library,
// reached as [SentencePiece apart] (sentencepiece_backend.h) says. As transformers' Llama tokenizer does, special
// tokens written in the text (the model's control pieces, "<unk>", tokenizer_config.json's added tokens) are split
// out first and each stretch of text between them is encoded by SentencePiece on its own (transformers' legacy
// behaviour); BOS and EOS are added as tokenizer_config.json's add_bos_token (default true) and add_eos_token
// (default false) say. decode gives control pieces as their text unless skipped, the runs between them decoded by
// SentencePiece.
#include <filesystem>
#include <memory>

#include "client_runtime/text/tokenizer.h"
#include "client_runtime/text/tokenizer_json.h"

namespace symbiosis::text {

std::unique_ptr<Tokenizer> open_sentencepiece(const std::filesystem::path& file, const TokenizerConfig& config);

}  // namespace symbiosis::text
