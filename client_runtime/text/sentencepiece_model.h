#pragma once
// Internal to text/: a checkpoint with a tokenizer.model (SentencePiece) and no tokenizer.json, tokenized as
// transformers 5 tokenizes it. [SentencePiece conversion] transformers no longer runs SentencePiece: it reads the
// model's pieces (the ModelProto, with protobuf) and builds a tokenizers pipeline of the class that
// tokenizer_config.json names. For LlamaTokenizer (Llama 2, Mistral, and any model whose checkpoint names that
// class, a Unigram model among them) and GemmaTokenizer (every Gemma generation) that is:
//   vocab          every piece, by its id;
//   merges         every split of a piece into two pieces, at a character boundary, ordered by the whole piece's
//                  id and then by the left part's length (transformers' generate_merges);
//   added tokens   the control pieces as special tokens, the user-defined pieces as plain ones, all matched in the
//                  text as written; then the class's special tokens (Llama's unknown, BOS and EOS, Gemma's those
//                  and padding and mask) as special ones, appended after the pieces where the model lacks them;
//   post-processor BOS and EOS as add_bos_token and add_eos_token say (both false when absent, for either class);
//   the rest       the class's own pipeline: Llama's honours legacy and add_prefix_space, Gemma's replaces spaces
//                  with "▁" and leaves the text between added tokens whole ([Tokenizer classes] in
//                  tokenizer_json.cpp).
// That tokenizer.json is then run as any other (tokenizer_json.h). Other classes build other pipelines (T5's, the
// generic one from the model's normalizer spec): a tokenizer.model of another class, or of none, is refused naming
// the class.
#include <filesystem>
#include <memory>

#include "client_runtime/text/tokenizer.h"
#include "client_runtime/text/tokenizer_json.h"

namespace symbiosis::text {

// Throws naming the file and what is wrong with it (not a SentencePiece model, a class not converted here).
std::unique_ptr<Tokenizer> open_sentencepiece_model(const std::filesystem::path& file, const TokenizerConfig& config);

}  // namespace symbiosis::text
