#pragma once
// Internal to text/: the BPE model of a tokenizer.json ("model": {"type": "BPE", ...}): a word (one
// pre-tokenizer piece, already mapped to the byte-level alphabet where the tokenizer does that) to token ids by
// applying the ranked merges, lowest rank first and leftmost first among equals, as Hugging Face tokenizers'
// BPE does without dropout. Thread-safe; words seen before come from a cache.
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace symbiosis::text {

class BpeModel {
 public:
  // Reads the "model" object of tokenizer.json (`where` names it in errors: "<file>: model"). Throws naming the
  // field when vocab or merges are missing or malformed, or a merge names a token the vocabulary lacks.
  BpeModel(const nlohmann::json& model, const std::string& where);

  // Appends the ids of `word` to `ids`.
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const;
  std::optional<int64_t> token_to_id(std::string_view token) const;
  // The token's text, or nullptr for an id the vocabulary lacks.
  const std::string* id_to_token(int64_t id) const;
  // One past the largest id of the vocabulary.
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  std::vector<int32_t> merge_word(std::string_view word) const;
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;             // by id; "" where no token has the id
  std::vector<bool> has_token_;                 // by id
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> rank and the merged token's id
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;

  // Guards cache_: the ids of words merged before (up to kCacheCapacity words of at most kLongestCachedWord bytes;
  // then no more are added).
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
  static constexpr size_t kCacheCapacity = 100000;
  static constexpr size_t kLongestCachedWord = 256;
};

}  // namespace symbiosis::text
