#pragma once
// Symbiosis client runtime, text: the checkpoint's tokenizer, as transformers tokenizes for it.
//  - Tokenizer::from_directory: tokenizer.json (byte-level BPE: GPT-2, Llama 3, Qwen2, StarCoder) or
//    tokenizer.model (SentencePiece: Llama 2, Gemma, Mistral); encode, decode, BOS and EOS;
//  - StreamingDecoder: generated ids to text as they arrive;
//  - StopStrings: the same, ending a request at a stop string (vLLM's `stop`).
// Needs no LibTorch header.
#include "client_runtime/text/stop_strings.h"
#include "client_runtime/text/streaming_decoder.h"
#include "client_runtime/text/tokenizer.h"
