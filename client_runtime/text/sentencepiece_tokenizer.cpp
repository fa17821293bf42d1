#include "client_runtime/text/sentencepiece_tokenizer.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include "client_runtime/text/sentencepiece_backend.h"
#include "client_runtime/text/unicode.h"

namespace symbiosis::text {
namespace {

constexpr const char* kBackendLibrary = "libsymbiosis_sentencepiece.so";
constexpr const char* kSentencePieceLibrary = "libsentencepiece.so.0";

using OpenBackend = SentencePieceBackend* (*)(const char*, std::string*);

// [SentencePiece apart] Loads SentencePiece (own symbols first, shown to no one) and then our backend library
// beside libsymbiosis_client.so, once per process; they stay loaded. Throws naming what did not load.
OpenBackend backend_entry_point() {
  static std::once_flag once;
  static OpenBackend open = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    if (dlopen(kSentencePieceLibrary, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND) == nullptr) {
      failure = std::string("cannot load the SentencePiece library (Debian's libsentencepiece0): ") + dlerror();
      return;
    }
    Dl_info self{};
    std::filesystem::path beside = kBackendLibrary;
    if (dladdr(reinterpret_cast<void*>(&backend_entry_point), &self) != 0 && self.dli_fname != nullptr) {
      beside = std::filesystem::path(self.dli_fname).parent_path() / kBackendLibrary;
    }
    void* backend = dlopen(beside.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (backend == nullptr) backend = dlopen(kBackendLibrary, RTLD_NOW | RTLD_LOCAL);
    if (backend == nullptr) {
      failure = std::string("cannot load ") + kBackendLibrary + " (looked beside the client library, at " +
                beside.string() + ", then on the library path; it is built where libsentencepiece-dev is installed): " +
                dlerror();
      return;
    }
    open = reinterpret_cast<OpenBackend>(dlsym(backend, "symbiosis_sentencepiece_open"));
    if (open == nullptr) failure = std::string(kBackendLibrary) + " lacks symbiosis_sentencepiece_open";
  });
  TORCH_CHECK(open != nullptr, "tokenizer: a tokenizer.model needs SentencePiece: ", failure);
  return open;
}

class SentencePieceTokenizer : public Tokenizer {
 public:
  SentencePieceTokenizer(std::unique_ptr<SentencePieceBackend> backend, const std::string& where,
                         const TokenizerConfig& config)
      : backend_(std::move(backend)),
        add_bos_(config.add_bos_token.value_or(true)),
        add_eos_(config.add_eos_token.value_or(false)) {
    const int size = backend_->piece_size();
    for (int id = 0; id < size; ++id) {
      if (backend_->is_control(id) || backend_->is_unknown(id)) add_special(id, backend_->id_to_piece(id));
    }
    for (const auto& added : config.added_tokens) {
      TORCH_CHECK(added.id >= 0 && added.id < size, "tokenizer_config.json: added token '", added.content, "' has id ",
                  added.id, ", outside ", where, "'s ", size, " pieces");
      if (added.special || backend_->is_control(static_cast<int>(added.id))) add_special(added.id, added.content);
      else splitter_pieces_.push_back({added.id, added.content});
    }
    // Longest first, so that the longest of the pieces starting at a position wins.
    std::stable_sort(splitter_pieces_.begin(), splitter_pieces_.end(),
                     [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
    const auto named = [&](const std::optional<std::string>& name, int fallback, const char* field) -> std::optional<int64_t> {
      if (!name) return fallback >= 0 ? std::optional<int64_t>(fallback) : std::nullopt;
      const auto id = token_to_id(*name);
      TORCH_CHECK(id.has_value(), "tokenizer_config.json: ", field, " '", *name, "' is not a piece of ", where);
      return id;
    };
    bos_ = named(config.bos_token, backend_->bos_id(), "bos_token");
    eos_ = named(config.eos_token, backend_->eos_id(), "eos_token");
    TORCH_CHECK(!add_bos_ || bos_, "tokenizer_config.json: add_bos_token is true, but ", where, " has no BOS piece");
    TORCH_CHECK(!add_eos_ || eos_, "tokenizer_config.json: add_eos_token is true, but ", where, " has no EOS piece");
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    const auto invalid = invalid_utf8_offset(text);
    TORCH_CHECK(!invalid, "tokenizer: the text is not UTF-8 (byte ", *invalid, " of ", text.size(), ")");
    std::vector<int64_t> ids;
    if (add_special_tokens && add_bos_) ids.push_back(*bos_);
    const auto encode_run = [&](std::string_view run) {
      for (const int id : backend_->encode(run)) ids.push_back(id);
    };
    size_t done = 0;
    for (size_t pos = 0; pos < text.size();) {
      const auto found = std::find_if(splitter_pieces_.begin(), splitter_pieces_.end(), [&](const auto& piece) {
        return text.compare(pos, piece.second.size(), piece.second) == 0;
      });
      if (found == splitter_pieces_.end()) {
        ++pos;
        continue;
      }
      if (pos > done) encode_run(text.substr(done, pos - done));
      ids.push_back(found->first);
      pos += found->second.size();
      done = pos;
    }
    if (done < text.size()) encode_run(text.substr(done));
    if (add_special_tokens && add_eos_) ids.push_back(*eos_);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::string text;
    std::vector<int> run;
    const int size = backend_->piece_size();
    for (const int64_t id : ids) {
      TORCH_CHECK(id >= 0 && id < size, "tokenizer: id ", id, " is outside the vocabulary [0, ", size, ")");
      if (!backend_->is_control(static_cast<int>(id)) && !special_added_.count(id)) {
        run.push_back(static_cast<int>(id));
        continue;
      }
      text += backend_->decode(run);
      run.clear();
      if (!skip_special_tokens) text += backend_->id_to_piece(static_cast<int>(id));
    }
    return text + backend_->decode(run);
  }

  std::optional<int64_t> bos_token_id() const override { return bos_; }
  std::optional<int64_t> eos_token_id() const override { return eos_; }
  int64_t vocab_size() const override { return backend_->piece_size(); }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    const int id = backend_->piece_to_id(token);
    if (backend_->is_unknown(id) && backend_->id_to_piece(id) != token) return std::nullopt;
    return id;
  }
  std::optional<std::string> id_to_token(int64_t id) const override {
    if (id < 0 || id >= backend_->piece_size()) return std::nullopt;
    return backend_->id_to_piece(static_cast<int>(id));
  }
  bool is_special(int64_t id) const override {
    return id >= 0 && id < backend_->piece_size() &&
           (backend_->is_control(static_cast<int>(id)) || special_added_.count(id) > 0);
  }

 private:
  void add_special(int64_t id, const std::string& content) {
    if (!backend_->is_control(static_cast<int>(id)) && !backend_->is_unknown(static_cast<int>(id))) {
      special_added_.insert(id);
    }
    if (!content.empty()) splitter_pieces_.push_back({id, content});
  }

  std::unique_ptr<SentencePieceBackend> backend_;
  bool add_bos_, add_eos_;
  std::optional<int64_t> bos_, eos_;
  std::vector<std::pair<int64_t, std::string>> splitter_pieces_;  // the tokens split out of the text
  std::unordered_set<int64_t> special_added_;  // special tokens that are not control pieces (decode skips them)
};

}  // namespace

std::unique_ptr<Tokenizer> open_sentencepiece(const std::filesystem::path& file, const TokenizerConfig& config) {
  const OpenBackend open = backend_entry_point();
  std::string error;
  std::unique_ptr<SentencePieceBackend> backend(open(file.c_str(), &error));
  TORCH_CHECK(backend != nullptr, "tokenizer: ", file.string(), " is not a SentencePiece model: ", error);
  return std::make_unique<SentencePieceTokenizer>(std::move(backend), file.string(), config);
}

}  // namespace symbiosis::text
