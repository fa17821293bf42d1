#pragma once
// Internal to text/: a checkpoint with a tokenizer.model (SentencePiece) and no tokenizer.json, tokenized as
// transformers 5 tokenizes it. [SentencePiece conversion] transformers no longer runs SentencePiece: it reads the
// model's pieces (the ModelProto, with protobuf) and builds a tokenizers pipeline of the class that
// tokenizer_config.json names. For LlamaTokenizer (Llama 2, Mistral, and any model whose checkpoint names that
// class, a Unigram model among them) that is:
//   vocab          every piece, by its id;
//   merges         every split of a piece into two pieces, at a character boundary, ordered by the whole piece's
//                  id and then by the left part's length (transformers' generate_merges);
//   added tokens   the control pieces and the unknown, BOS and EOS tokens as special tokens, the user-defined
//                  pieces as plain ones, all matched in the text as written;
//   post-processor BOS and EOS as add_bos_token and add_eos_token say (both false when absent);
//   the rest       LlamaTokenizer's own pipeline, which honours legacy and add_prefix_space ([Tokenizer classes]
//                  in tokenizer_json.cpp).
// That tokenizer.json is then run as any other (tokenizer_json.h). Other classes build other pipelines (T5's,
// Gemma's, the generic one from the model's normalizer spec): a tokenizer.model of another class, or of none, is
// refused naming the class.
#include <filesystem>
#include <memory>

#include "client_runtime/text/tokenizer.h"
#include "client_runtime/text/tokenizer_json.h"

namespace symbiosis::text {

// Throws naming the file and what is wrong with it (not a SentencePiece model, a class not converted here).
std::unique_ptr<Tokenizer> open_sentencepiece_model(const std::filesystem::path& file, const TokenizerConfig& config);

}  // namespace symbiosis::text
