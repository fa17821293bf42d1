#include "client_runtime/text/sentencepiece_model.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iterator>
#include <unordered_map>

#include "client_runtime/text/unicode.h"

namespace symbiosis::text {
namespace {

using nlohmann::json;

// SentencePiece's ModelProto.SentencePiece.Type.
enum class PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

struct Piece {
  std::string text;
  PieceType type = PieceType::kNormal;
};

// Just enough of protobuf's wire format to read ModelProto's pieces (field 1: SentencePiece {piece = 1,
// score = 2, type = 3}); every other field is skipped. Throws naming `where` and the byte where the file breaks.
class WireReader {
 public:
  WireReader(std::string_view bytes, const std::string& where, size_t base = 0)
      : bytes_(bytes), where_(where), base_(base) {}
  bool done() const { return pos_ >= bytes_.size(); }
  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      check(pos_ < bytes_.size());
      const auto byte = static_cast<unsigned char>(bytes_[pos_++]);
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    check(false);
    return 0;
  }
  // A field's (number, wire type); then the caller reads its value with one of the calls below.
  std::pair<uint64_t, int> key() {
    const uint64_t key = varint();
    return {key >> 3, static_cast<int>(key & 7)};
  }
  // A length-delimited value, and where it starts in the file.
  std::string_view bytes(size_t& at) {
    const uint64_t length = varint();
    check(length <= bytes_.size() - pos_);
    at = base_ + pos_;
    pos_ += length;
    return bytes_.substr(pos_ - length, length);
  }
  void skip(int wire_type) {
    size_t at = 0;
    switch (wire_type) {
      case 0: varint(); return;
      case 1: advance(8); return;
      case 2: bytes(at); return;
      case 5: advance(4); return;
      default: check(false);
    }
  }

 private:
  void advance(size_t n) {
    check(n <= bytes_.size() - pos_);
    pos_ += n;
  }
  void check(bool ok) const {
    TORCH_CHECK(ok, "tokenizer: ", where_, " is not a SentencePiece model: its protobuf breaks at byte ", base_ + pos_);
  }

  std::string_view bytes_;
  const std::string& where_;
  size_t base_, pos_ = 0;
};

std::vector<Piece> read_pieces(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in, "tokenizer: cannot read ", file.string());
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string where = file.string();
  std::vector<Piece> pieces;
  WireReader model(data, where);
  while (!model.done()) {
    const auto [number, wire_type] = model.key();
    if (number != 1 || wire_type != 2) {
      model.skip(wire_type);
      continue;
    }
    size_t at = 0;
    const std::string_view message = model.bytes(at);
    WireReader reader(message, where, at);
    Piece piece;
    while (!reader.done()) {
      const auto [field, type] = reader.key();
      if (field == 1 && type == 2) {
        piece.text = std::string(reader.bytes(at));
      } else if (field == 3 && type == 0) {
        piece.type = static_cast<PieceType>(reader.varint());
      } else {
        reader.skip(type);
      }
    }
    TORCH_CHECK(!invalid_utf8_offset(piece.text), "tokenizer: ", where, ": piece ", pieces.size(), " is not UTF-8");
    pieces.push_back(std::move(piece));
  }
  TORCH_CHECK(!pieces.empty(), "tokenizer: ", where, " is not a SentencePiece model: it has no pieces");
  return pieces;
}

// [SentencePiece conversion] transformers' generate_merges(vocab): each piece split in two at every character
// boundary where both halves are pieces, ordered by the piece's id, then by the left half's length (the order in
// which they are made here).
json merges_of(const std::vector<Piece>& pieces, const std::unordered_map<std::string, int64_t>& vocab) {
  json merges = json::array();
  for (const Piece& piece : pieces) {
    const std::string& text = piece.text;
    if (text.empty()) continue;
    for (size_t cut = utf8_length(static_cast<unsigned char>(text[0])); cut < text.size();
         cut += utf8_length(static_cast<unsigned char>(text[cut]))) {
      std::string left = text.substr(0, cut), right = text.substr(cut);
      if (vocab.count(left) && vocab.count(right)) merges.push_back({std::move(left), std::move(right)});
    }
  }
  return merges;
}

}  // namespace

std::unique_ptr<Tokenizer> open_sentencepiece_model(const std::filesystem::path& file, const TokenizerConfig& written) {
  const std::string where = file.string();
  const TokenizerClass* built = class_building_pipeline(written);
  TORCH_CHECK(built, "tokenizer: ", where, " is a SentencePiece model without a tokenizer.json ",
              "and tokenizer_config.json's tokenizer_class is ",
              written.tokenizer_class ? "'" + *written.tokenizer_class + "'" : std::string("not given"),
              ": transformers builds such a tokenizer with that class's own converter, and only these classes' are "
              "implemented here: ",
              classes_building_pipelines(),
              " (with or without Fast); save the tokenizer with "
              "transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) to write its tokenizer.json");
  const std::vector<Piece> pieces = read_pieces(file);
  std::unordered_map<std::string, int64_t> ids;
  json vocab = json::object();
  for (size_t id = 0; id < pieces.size(); ++id) {
    ids.try_emplace(pieces[id].text, static_cast<int64_t>(id));
    vocab[pieces[id].text] = id;
  }
  // The control pieces are special added tokens, the user-defined ones plain ones; the class's own special tokens
  // are made special by the pipeline ([Tokenizer classes] in tokenizer_json.cpp).
  json added = json::array();
  for (size_t id = 0; id < pieces.size(); ++id) {
    const bool control = pieces[id].type == PieceType::kControl;
    if (!control && pieces[id].type != PieceType::kUserDefined) continue;
    added.push_back({{"id", id},
                     {"content", pieces[id].text},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", control}});
  }
  const TokenizerConfig config = with_class_defaults(written, *built);
  json single = json::array();
  json special_tokens = json::object();
  const auto around = [&](const std::optional<bool>& add, const std::string& name, const char* field) {
    if (!add.value_or(false)) return;
    const auto it = ids.find(name);
    TORCH_CHECK(it != ids.end(), "tokenizer_config.json: ", field, " is true, but '", name, "' is not a piece of ",
                where);
    single.push_back({{"SpecialToken", {{"id", name}, {"type_id", 0}}}});
    special_tokens[name] = {{"id", name}, {"ids", {it->second}}, {"tokens", {name}}};
  };
  around(config.add_bos_token, *config.bos_token, "add_bos_token");
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  around(config.add_eos_token, *config.eos_token, "add_eos_token");
  const json converted = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges_of(pieces, ids)}}},
      {"added_tokens", added},
      {"post_processor", {{"type", "TemplateProcessing"}, {"single", single}, {"special_tokens", special_tokens}}}};
  return make_tokenizer_json(converted, where, written);
}

}  // namespace symbiosis::text
