#include "transport/keys.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <zmq.h>

#include <fstream>
#include <regex>
#include <sstream>

namespace symbiosis::keys {
namespace {

constexpr size_t kZ85KeyLength = 40;

std::string field(const std::string& text, const std::string& name) {
  const std::regex pattern(name + R"(\s*=\s*"([^"]*)\")");
  std::smatch match;
  return std::regex_search(text, match, pattern) ? match[1].str() : "";
}

}  // namespace

bool well_formed(const std::string& text) {
  if (text.size() != kZ85KeyLength) return false;
  uint8_t decoded[32];
  return zmq_z85_decode(decoded, text.c_str()) != nullptr;
}

KeyPair generate() {
  char public_key[kZ85KeyLength + 1], secret_key[kZ85KeyLength + 1];
  TORCH_CHECK(zmq_curve_keypair(public_key, secret_key) == 0,
              "cannot make a CURVE key pair: this libzmq was built without CURVE (libsodium)");
  return {public_key, secret_key};
}

void write(const std::filesystem::path& stem, const KeyPair& pair) {
  const auto secret_path = std::filesystem::path(stem.string() + ".key");
  const auto public_path = std::filesystem::path(stem.string() + ".pub");
  TORCH_CHECK(!std::filesystem::exists(secret_path) && !std::filesystem::exists(public_path), "a key pair ",
              stem.string(), " exists already; remove it first to replace it");
  if (stem.has_parent_path()) std::filesystem::create_directories(stem.parent_path());
  {
    const mode_t before = ::umask(077);  // the secret is never readable by others, not even briefly
    std::ofstream secret(secret_path);
    ::umask(before);
    secret << "#   symbiosis key pair: keep this file secret\ncurve\n    public-key = \"" << pair.public_key
           << "\"\n    secret-key = \"" << pair.secret_key << "\"\n";
    TORCH_CHECK(secret.good(), "cannot write ", secret_path.string());
  }
  std::ofstream open_half(public_path);
  open_half << "#   symbiosis public key\ncurve\n    public-key = \"" << pair.public_key << "\"\n";
  TORCH_CHECK(open_half.good(), "cannot write ", public_path.string());
}

KeyPair read(const std::filesystem::path& path, bool need_secret) {
  std::ifstream in(path);
  TORCH_CHECK(in, "cannot read key file ", path.string());
  std::stringstream text;
  text << in.rdbuf();
  KeyPair pair{field(text.str(), "public-key"), field(text.str(), "secret-key")};
  TORCH_CHECK(well_formed(pair.public_key), "key file ", path.string(),
              " has no well-formed public-key (40 Z85 characters; symbiosis-ctl keygen writes them)");
  if (need_secret) {
    TORCH_CHECK(well_formed(pair.secret_key), "key file ", path.string(),
                " has no well-formed secret-key: give the NAME.key file of the pair, not NAME.pub");
  }
  return pair;
}

std::string public_key(const std::string& text_or_path) {
  if (well_formed(text_or_path)) return text_or_path;
  return read(text_or_path, /*need_secret=*/false).public_key;
}

}  // namespace symbiosis::keys
