#pragma once
// [Admission]
// An executor started with keys (ExecutorOptions::keys_dir) speaks CURVE on its socket: every
// byte on the wire is encrypted, and every peer proves a key pair. ZeroMQ asks the ZAP handler
// (here, polled by the front door's thread, so it reads the front door's Keys as reloaded) about
// each peer whose handshake reaches its last step, and the handler decides there: an admitted key
// (tenants/ or operators/) is answered 200 and the connection tagged with the key (the ZAP user
// id); an unknown or revoked key is answered 400 ("key not admitted", "key revoked"), and ZeroMQ
// closes the connection before any message of the peer's is read, let alone decrypted. The
// client's socket reports the refusal (ZMQ_EVENT_HANDSHAKE_FAILED_AUTH with the status code;
// ZeroMQ carries only the code, not the text), and the client runtime says so: "refused this
// client's key at the handshake (ZAP 400: not admitted or revoked)". What a key may do is also
// looked up at each of its messages, so a key revoked or removed on disk while its peer is
// connected is refused from its next message on ("refused: this client's key was revoked"); the
// front door also drops the clients it had (Keys::reload says when the folder changed).
//
// What a peer not (yet) admitted can make the executor hold: ZeroMQ's state for one connection
// in handshake. Measured on this project's libzmq (4.3.4), VmRSS of a symbiosis-executor process
// with --keys, 500 raw connections at once: about 4 KiB a connection that says nothing, about
// 80 KiB one that has sent a CURVE greeting and 60 KB of a handshake command; every one of them
// dropped kHandshakeInterval later, whatever it sends. A stock CURVE peer (any ZeroMQ client,
// ours included) whose key is not admitted is refused within milliseconds of connecting: the
// eight strangers of AdmissionTest.StrangersWithTheirLargestFramesCostNothingAndAnHonestTenant-
// StaysExact, each queueing frames of --max-message-bytes on connection after connection (some
// 200 refusals in a run), grew the executor's process by 4 MiB (the test checks 64 MiB).
// Bounded since: ZeroMQ decodes handshake commands under the socket's ZMQ_MAXMSGSIZE, so the
// executor's frame limit is small (1 MiB + 64 KiB: payloads travel in frames of 1 MiB, [Bounded
// frames] in transport/zmq_wire.h), and a hand-made peer that announces a huge handshake command is
// cut at the announcement; connections in handshake are capped (--max-handshakes, [Connections in
// handshake] in connections.cpp). Before, two such peers on loopback held 510 MiB for the 5 s.
//
// Identity is the key: with keys, a tenant is named by its key's file stem in statistics, metrics
// and logs (Keys::Entry::name); a Hello whose tenant names another admitted key is refused, and
// any other label in it is replaced by the key's name (FrontDoor::handle_hello). Without keys,
// tenant names are the clients' own labels.
//
// The keys folder ([Admission keys] in transport/keys.h for the files):
//   executor.key      the executor's pair
//   tenants/*.pub     tenants it admits (the file name names the tenant)
//   operators/*.pub   operators: tenants that may also ask for statistics and what comes later
//   revoked/*.pub     keys refused as revoked, wherever else they are listed
#include <zmq.hpp>

#include <chrono>
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
  // Whether `name` is the name of a key that is admitted (a tenant's or an operator's).
  bool admits_name(const std::string& name) const;
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

// [Admission]: how long a connection may take to finish its handshake (CURVE's, or ZeroMQ's
// greeting without keys) before the executor drops it. A handshake takes a few round trips and
// one ZAP answer; seconds leave room for a slow network and a busy front door.
constexpr std::chrono::milliseconds kHandshakeInterval{5000};

// Puts the executor's pair on `socket` (before it binds) as a CURVE server.
void serve_with_keys(zmq::socket_t& socket, const Keys& keys);

// The ZAP handler of `context`: bound before any CURVE socket of the context binds.
class ZapHandler {
 public:
  explicit ZapHandler(zmq::context_t& context);
  zmq::socket_t& socket() { return socket_; }
  // What answer() decided about one peer.
  struct Verdict {
    bool admitted = false;
    Role role = Role::kUnknown;  // the key's, as `keys` lists it
    std::string public_key;      // Z85; empty when the peer offered no CURVE key
  };
  // [Admission]: answers the request waiting on the socket (it polled readable), admitting only
  // the keys `keys` admits.
  Verdict answer(const Keys& keys);

 private:
  zmq::socket_t socket_;
};

// The public key a message's connection was admitted with ("" without keys).
std::string peer_key(const zmq::message_t& frame);

}  // namespace symbiosis
