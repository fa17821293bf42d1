#pragma once
// [Admission]
// An executor started with keys (ExecutorOptions::keys_dir) speaks CURVE on its socket: every
// byte on the wire is encrypted, and every peer proves a key pair. ZeroMQ asks the ZAP handler
// (here, polled by the front door's thread) about each peer that connects; it lets every
// well-formed key through and tags the connection with it (the ZAP user id), so that the front
// door can answer a peer whose key is not admitted with a refusal that says why in a few words
// ("not admitted", "revoked") instead of a silent drop. What a key may do is looked up at each of
// its messages, so a key revoked or removed on disk is refused from its next message on; the
// front door also drops the clients it had (Keys::reload says when the folder changed).
//
// The keys folder ([Admission keys] in transport/keys.h for the files):
//   executor.key      the executor's pair
//   tenants/*.pub     tenants it admits (the file name names the tenant in the log)
//   operators/*.pub   operators: tenants that may also ask for statistics and what comes later
//   revoked/*.pub     keys refused as revoked, wherever else they are listed
#include <zmq.hpp>

#include <filesystem>
#include <map>
#include <string>

#include "transport/keys.h"

namespace symbiosis {

enum class Role { kUnknown, kTenant, kOperator, kRevoked };

class Keys {
 public:
  // Reads the folder; throws naming what is missing or malformed.
  explicit Keys(std::filesystem::path folder);

  const keys::KeyPair& executor_pair() const { return executor_; }
  struct Entry {
    Role role = Role::kUnknown;
    std::string name;  // the key file's stem
  };
  // The key's entry; an unknown key's role is kUnknown.
  const Entry& lookup(const std::string& public_key) const;
  // Reads the folder again if anything in it changed since; true when it did. A folder that no
  // longer reads keeps the keys it had (the error goes to the log).
  bool reload();

 private:
  std::string fingerprint() const;
  void read();

  std::filesystem::path folder_;
  keys::KeyPair executor_;
  std::map<std::string, Entry> entries_;  // by public key
  std::string fingerprint_;
};

// Puts the executor's pair on `socket` (before it binds) as a CURVE server.
void serve_with_keys(zmq::socket_t& socket, const Keys& keys);

// The ZAP handler of `context`: bound before any CURVE socket of the context binds.
class ZapHandler {
 public:
  explicit ZapHandler(zmq::context_t& context);
  zmq::socket_t& socket() { return socket_; }
  // Answers the request waiting on the socket (it polled readable).
  void answer();

 private:
  zmq::socket_t socket_;
};

// The public key a message's connection was admitted with ("" without keys).
std::string peer_key(const zmq::message_t& frame);

}  // namespace symbiosis
