#pragma once
// Internal to text/: the SentencePiece library as the client library reaches it. [SentencePiece apart]
// Debian's libsentencepiece.so.0 carries its own copy of protobuf-lite 3.14 and exports its symbols unversioned;
// libsymbiosis_client.so links the system's libprotobuf.so.32 (3.21) for the wire protocol. In one process the
// two copies bind to each other's functions, and the first to initialize aborts ("compiled against version
// 3.14.0 of the Protocol Buffer runtime library, which is not compatible with the installed version"). So the
// client never links SentencePiece: a small library of its own, libsymbiosis_sentencepiece.so (this interface,
// sentencepiece_backend.cpp), links it, and sentencepiece_tokenizer.cpp loads both with dlopen, SentencePiece
// with RTLD_DEEPBIND and RTLD_LOCAL so that it binds to its own protobuf and shows it to no one else.
// Errors cross this boundary as values (an error string), never as exceptions.
#include <string>
#include <string_view>
#include <vector>

namespace symbiosis::text {

class SentencePieceBackend {
 public:
  virtual ~SentencePieceBackend() = default;
  virtual std::vector<int> encode(std::string_view text) const = 0;
  // SentencePiece's decoding of pieces (control pieces give nothing, the unknown piece " ⁇ ").
  virtual std::string decode(const std::vector<int>& ids) const = 0;
  virtual int piece_size() const = 0;
  virtual std::string id_to_piece(int id) const = 0;
  virtual int piece_to_id(std::string_view piece) const = 0;  // the unknown piece's id when there is none
  virtual bool is_control(int id) const = 0;
  virtual bool is_unknown(int id) const = 0;
  virtual int bos_id() const = 0;  // -1 when the model has none
  virtual int eos_id() const = 0;
};

}  // namespace symbiosis::text

// The one entry point of libsymbiosis_sentencepiece.so: the model in `path`, or nullptr with `error` set.
// The caller owns the result (deleting it runs the library's code: the library stays loaded).
extern "C" __attribute__((visibility("default"))) symbiosis::text::SentencePieceBackend* symbiosis_sentencepiece_open(const char* path, std::string* error);
