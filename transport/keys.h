#pragma once
// [Admission keys] (docs/operating.md)
// CURVE key pairs for ZeroMQ's encryption and the executor's admission of tenants: 40-character
// Z85 texts, as ZeroMQ takes them. A pair lives in NAME.key (owner-only: it holds the secret) and
// its public half in NAME.pub, both written by `symbiosis-ctl keygen NAME`, in ZeroMQ's own
// certificate layout:
//     curve
//         public-key = "..."
//         secret-key = "..."        (NAME.key only)
#include <filesystem>
#include <string>

namespace symbiosis::keys {

struct KeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters; empty in a public-only file
};

KeyPair generate();
// Writes STEM.key (mode 0600) and STEM.pub; refuses to overwrite an existing pair.
void write(const std::filesystem::path& stem, const KeyPair& pair);
// Reads a pair or a public key from `path`; throws naming the file and what it lacks.
KeyPair read(const std::filesystem::path& path, bool need_secret);
// A public key given as its 40 Z85 characters, or as a file holding it.
std::string public_key(const std::string& text_or_path);
// Whether `text` is a well-formed Z85 CURVE key.
bool well_formed(const std::string& text);

}  // namespace symbiosis::keys
