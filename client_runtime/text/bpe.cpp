#include "client_runtime/text/bpe.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <queue>

#include "client_runtime/text/unicode.h"

namespace symbiosis::text {
namespace {

// The two tokens of a merge: ["a", "b"] (tokenizers 0.20 and later) or "a b" (earlier files).
std::pair<std::string, std::string> merge_pair(const nlohmann::json& merge, const std::string& where, size_t rank) {
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    return {merge[0].get<std::string>(), merge[1].get<std::string>()};
  }
  if (merge.is_string()) {
    const auto text = merge.get<std::string>();
    const size_t space = text.find(' ', 1);  // the first token may itself be a space in some files
    if (space != std::string::npos && space + 1 < text.size()) return {text.substr(0, space), text.substr(space + 1)};
  }
  TORCH_CHECK(false, where, ".merges[", rank, "] should be [\"left\", \"right\"] or \"left right\", got ",
              merge.dump());
}

}  // namespace

BpeModel::BpeModel(const nlohmann::json& model, const std::string& where) {
  const auto vocab = model.find("vocab");
  TORCH_CHECK(vocab != model.end() && vocab->is_object(), where, ".vocab should be an object of token: id");
  int64_t largest = -1;
  for (const auto& [token, id] : vocab->items()) {
    TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < INT32_MAX, where, ".vocab[\"",
                token, "\"] should be an id (a whole number >= 0), got ", id.dump());
    vocab_.emplace(token, id.get<int32_t>());
    largest = std::max(largest, id.get<int64_t>());
  }
  tokens_.resize(static_cast<size_t>(largest + 1));
  has_token_.resize(tokens_.size());
  for (const auto& [token, id] : vocab_) {
    tokens_[static_cast<size_t>(id)] = token;
    has_token_[static_cast<size_t>(id)] = true;
  }
  const auto merges = model.find("merges");
  TORCH_CHECK(merges != model.end() && merges->is_array(), where, ".merges should be an array");
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const auto [left, right] = merge_pair((*merges)[rank], where, rank);
    const auto l = vocab_.find(left), r = vocab_.find(right), merged = vocab_.find(left + right);
    TORCH_CHECK(l != vocab_.end() && r != vocab_.end() && merged != vocab_.end(), where, ".merges[", rank, "] (\"",
                left, "\", \"", right, "\") names a token that ", where, ".vocab lacks");
    merges_.try_emplace(pair_key(l->second, r->second), Merge{static_cast<int32_t>(rank), merged->second});
  }
  const auto text_field = [&](const char* name) -> std::optional<std::string> {
    const auto it = model.find(name);
    if (it == model.end() || it->is_null()) return std::nullopt;
    TORCH_CHECK(it->is_string(), where, ".", name, " should be a string or null, got ", it->dump());
    return it->get<std::string>();
  };
  const auto flag = [&](const char* name) {
    const auto it = model.find(name);
    if (it == model.end() || it->is_null()) return false;
    TORCH_CHECK(it->is_boolean(), where, ".", name, " should be true or false, got ", it->dump());
    return it->get<bool>();
  };
  if (const auto unk = text_field("unk_token")) {
    const auto it = vocab_.find(*unk);
    TORCH_CHECK(it != vocab_.end(), where, ".unk_token \"", *unk, "\" is not in ", where, ".vocab");
    unk_id_ = it->second;
  }
  for (const char* name : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto affix = text_field(name);
    TORCH_CHECK_NOT_IMPLEMENTED(!affix || affix->empty(), where, ".", name, " \"", *affix,
                                "\" is not supported (byte-level BPE tokenizers have none)");
  }
  const auto dropout = model.find("dropout");
  TORCH_CHECK_NOT_IMPLEMENTED(dropout == model.end() || dropout->is_null() || *dropout == 0.0, where,
                              ".dropout is not supported (it is for training)");
  fuse_unk_ = flag("fuse_unk");
  byte_fallback_ = flag("byte_fallback");
  ignore_merges_ = flag("ignore_merges");
}

std::optional<int64_t> BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int64_t id) const {
  if (id < 0 || id >= size() || !has_token_[static_cast<size_t>(id)]) return nullptr;
  return &tokens_[static_cast<size_t>(id)];
}

void BpeModel::encode_word(std::string_view word, std::vector<int64_t>& ids) const {
  if (ignore_merges_) {
    // Llama 3: a word that is a token is that token, whatever the merges would make of it.
    if (const auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  // Long words are not cached (tokenizers' cache skips them too): a Gemma-class tokenizer's word is all the text
  // between two added tokens, a whole prompt ([Tokenizer classes] in tokenizer_json.cpp).
  const bool cached = word.size() <= kLongestCachedWord;
  if (cached) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = cache_.find(std::string(word)); it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> merged = merge_word(word);
  ids.insert(ids.end(), merged.begin(), merged.end());
  if (!cached) return;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::move(merged));
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  // The word's characters as symbols (a doubly linked list over `symbols`), each a token of the vocabulary;
  // characters it lacks become their bytes' <0xXX> tokens (byte_fallback), the unknown token (fused when
  // fuse_unk), or nothing, as tokenizers does.
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
    bool alive = true;
  };
  std::vector<Symbol> symbols;
  const auto add = [&](int32_t id) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1});
  };
  bool last_was_unk = false;
  for (size_t pos = 0; pos < word.size();) {
    const size_t length = std::min(utf8_length(static_cast<unsigned char>(word[pos])), word.size() - pos);
    const std::string character(word.substr(pos, length));
    pos += length;
    if (const auto it = vocab_.find(character); it != vocab_.end()) {
      add(it->second);
      last_was_unk = false;
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> bytes;
      for (const char byte : character) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned char>(byte));
        if (const auto it = vocab_.find(name); it != vocab_.end()) bytes.push_back(it->second);
      }
      if (bytes.size() == character.size()) {
        for (const int32_t id : bytes) add(id);
        last_was_unk = false;
        continue;
      }
    }
    if (unk_id_) {
      if (!(fuse_unk_ && last_was_unk)) add(*unk_id_);
      last_was_unk = true;
    }
  }
  // Merge the lowest-ranked adjacent pair, leftmost first among equal ranks, until none applies. Queue entries
  // go stale as symbols merge; a popped one is used only while both its symbols are alive and unchanged.
  struct Candidate {
    int32_t rank, left, result, left_id, right_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto consider = [&](int32_t left) {
    const int32_t right = symbols[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const int32_t a = symbols[static_cast<size_t>(left)].id, b = symbols[static_cast<size_t>(right)].id;
    if (const auto it = merges_.find(pair_key(a, b)); it != merges_.end()) {
      queue.push({it->second.rank, left, it->second.result, a, b});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<size_t>(c.left)];
    if (!left.alive || left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    if (right.id != c.right_id) continue;
    left.id = c.result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = c.left;
    if (left.prev >= 0) consider(left.prev);
    consider(c.left);
  }
  std::vector<int32_t> ids;
  for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) {
    ids.push_back(symbols[static_cast<size_t>(i)].id);
  }
  return ids;
}

}  // namespace symbiosis::text
