#pragma once
// Symbiosis client runtime, inference: generation from a model and its adapter, split or monolithic.
//  - Generator: submit requests of prompt token ids, receive tokens as they are produced (a
//    callback per request), cancel; continuous batching over one KV cache of a stated capacity;
//  - SamplingParams: greedy, temperature, top-k, top-p, a per-request seed, stop tokens, a maximum
//    length and per-token log-probabilities;
//  - heterogeneous placement: Generator(prefill_lm, host_decode_lm, ...) prefills on a GPU, keeps the
//    cache in host memory and decodes on the CPU ([Host decode] in inference/heterogeneous.h);
//  - KvCache and CachedStep (models/kv_cache.h): the cache the models generate with.
#include "client_runtime/inference/generator.h"
#include "client_runtime/inference/heterogeneous.h"
#include "client_runtime/inference/sampling.h"
#include "client_runtime/models/kv_cache.h"
