#pragma once
// The model hash of a checkpoint ([Weight hash] in weight_hash.cpp), for Checkpoint::open. Internal
// to common/: callers read it as Checkpoint::model_hash().
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "common/checkpoint.h"

namespace symbiosis {

// One tensor as the hash reads it: its record and its bytes (in the checkpoint's mapped file).
struct HashedTensor {
  const TensorRecord* record;
  const char* data;
  size_t bytes;
};

// The model hash of the checkpoint in `dir`: `config_text`, then `tensors` in name order, each with
// the digest of its bytes, taken from the digest cache where its file is unchanged, else computed
// (and the cache rewritten). Thread-safe: a cache is written whole, then renamed into place.
std::string compute_model_hash(const std::filesystem::path& dir, const std::string& config_text,
                               const std::vector<HashedTensor>& tensors);

}  // namespace symbiosis
