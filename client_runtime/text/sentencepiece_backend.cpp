// libsymbiosis_sentencepiece.so: SentencePieceBackend over the SentencePiece library ([SentencePiece apart] in
// sentencepiece_backend.h). Nothing here may throw out of the library.
#include "client_runtime/text/sentencepiece_backend.h"

#include <sentencepiece_processor.h>

#include <exception>
#include <memory>

namespace symbiosis::text {
namespace {

class LibraryBackend : public SentencePieceBackend {
 public:
  sentencepiece::SentencePieceProcessor processor;

  std::vector<int> encode(std::string_view text) const override {
    std::vector<int> ids;
    processor.Encode(text, &ids);  // fails only for a model that did not load
    return ids;
  }
  std::string decode(const std::vector<int>& ids) const override {
    std::string text;
    processor.Decode(ids, &text);
    return text;
  }
  int piece_size() const override { return processor.GetPieceSize(); }
  std::string id_to_piece(int id) const override { return processor.IdToPiece(id); }
  int piece_to_id(std::string_view piece) const override { return processor.PieceToId(piece); }
  bool is_control(int id) const override { return processor.IsControl(id); }
  bool is_unknown(int id) const override { return processor.IsUnknown(id); }
  int bos_id() const override { return processor.bos_id(); }
  int eos_id() const override { return processor.eos_id(); }
};

}  // namespace
}  // namespace symbiosis::text

extern "C" symbiosis::text::SentencePieceBackend* symbiosis_sentencepiece_open(const char* path, std::string* error) {
  try {
    auto backend = std::make_unique<symbiosis::text::LibraryBackend>();
    const auto status = backend->processor.Load(path);
    if (!status.ok()) {
      *error = status.ToString();
      return nullptr;
    }
    return backend.release();
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}
