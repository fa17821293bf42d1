#pragma once
// The client's connection to the executor: its ZeroMQ DEALER socket (the handshake, set-up
// messages, tcp calls, operators' requests) and, for a same-host transport, its proven local link;
// what it throws when the executor is gone or busy.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <deque>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/unique_fd.h"
#include "symbiosis.pb.h"
#include "transport/keys.h"

namespace symbiosis {

// [Executor restart] (client_runtime/client.cpp): the connection to the executor is lost: it said
// it shuts down, or its socket or this client's local link broke off (it stopped, crashed or is
// restarting). No call made through the connection can be answered any more; a Client reconnects
// and retries the call. A c10::Error, so callers that do not reconnect see it as any other.
class ExecutorLost : public c10::Error {
 public:
  using c10::Error::Error;
};

// [Back-pressure] (client_runtime/client.cpp): the executor refused this call with
// RESOURCE_EXHAUSTED, and the transport can send it again (the refusal left it usable). A Client
// sends the call again after a pause while the refusal is for overload; a c10::Error, so callers
// that do not retry see it as any other.
class ExecutorBusy : public c10::Error {
 public:
  using c10::Error::Error;
};

// [Error model] (common/status.h): the one place an executor's error answer becomes an exception, as
// "executor error (CODE)[ on ON]: message": `on` says what it answered ("layer 'NAME'"; empty for
// an answer to no call); RESOURCE_EXHAUSTED is ExecutorBusy where `can_send_again` (the transport
// survives the refusal: [Back-pressure]), every other a c10::Error.
[[noreturn]] void throw_executor_error(proto::ErrorCode code, const std::string& message, const std::string& on = "",
                                       bool can_send_again = false);

// [Admission keys] (transport/keys.h): what a client needs for an executor started with keys.
struct ClientKeys {
  std::string executor_key;  // the executor's public key (Z85); empty: no keys
  keys::KeyPair own;         // this tenant's pair
};

// The client's DEALER socket to the executor: handshake, set-up messages, and TCP calls; and, for
// a same-host transport, the client's local link ([Proven placement] in transport/local_socket.h).
class ControlSocket {
 public:
  // connect_timeout_ms: how long to wait for the first answer (the handshake); -1: timeout_ms.
  ControlSocket(const std::string& endpoint, int timeout_ms, const ClientKeys& keys = {}, int connect_timeout_ms = -1);
  // Sends the Hello and returns the Welcome. A same-host transport is proved first on the
  // executor's local socket; a client that asked for "auto" and cannot prove it (it is on another
  // host, or in another PID namespace) falls back to tcp, saying why in the log.
  proto::Welcome handshake(proto::Envelope hello);
  // A set-up message (RegisterBuffer, ShareSegments, NcclSetup): on the local link with
  // `descriptor` (if >= 0) once proven; otherwise over ZeroMQ (an nccl client on another host).
  void send_setup(const proto::Envelope& envelope, int descriptor = -1);
  // The same, returning the answer (which comes over ZeroMQ).
  proto::Envelope exchange_setup(const proto::Envelope& envelope, const char* waiting_for, int descriptor = -1);
  // The descriptors the proof brought: the control segment, then the wake socket ([Wake sockets] in transport/call_ring.h). Taken once.
  std::vector<UniqueFd> take_descriptors() { return std::move(descriptors_); }
  // Sends a header frame, then the tensor's bytes as a second frame when given (CPU, contiguous).
  void send(const proto::Envelope& envelope, const at::Tensor* payload = nullptr);
  // The next message, or a c10::Error naming the executor when none comes within the timeout (the
  // connect timeout for the first answer; sooner where connections are refused: [No silent
  // waits]), or naming why the encrypted handshake failed; an ExecutorLost once the connection is
  // lost ([Shutdown notice] in base_executor/front_door.cpp, [Executor restart]).
  std::vector<zmq::message_t> receive(const char* waiting_for);
  // [Executor restart]: whether the connection is lost; looks, without waiting, for the executor's
  // shutdown notice, a broken-off connection and a local link the executor closed (a same-host
  // call looks while it waits on its control segment), and keeps any other message that came
  // meanwhile for receive(). Not thread-safe, like the rest of this class.
  bool executor_gone();
  // Throws ExecutorLost, saying why, once the connection is lost.
  void check_not_gone() const;
  // Whether the executor closed this client's local link (it stopped: the link carries nothing
  // after the set-up). Only looks, so any thread may ask, unlike the rest of this class.
  bool link_closed() const;
  // Whether the executor has answered (a failure after that is its refusal, not its absence).
  bool heard() const { return heard_; }
  // Sends and returns the answer; an executor error becomes a c10::Error carrying its message.
  proto::Envelope exchange(const proto::Envelope& envelope, const char* waiting_for);
  static proto::Envelope parse_or_throw(const std::vector<zmq::message_t>& frames);
  const std::string& endpoint() const { return endpoint_; }
  int timeout_ms() const { return timeout_ms_; }

 private:
  // Throws naming why, if the monitor reports a failed handshake ([Handshake diagnosis] in
  // control_socket.cpp).
  void check_handshake(const zmq::message_t& event);
  // [Handshake diagnosis]: throws what the connection's end during the handshake (`how`) was,
  // by what answers at the endpoint now.
  [[noreturn]] void handshake_broke_off(const std::string& how);
  // Sends the Hello and returns the answer; one that is not a symbiosis message throws naming it.
  proto::Envelope handshake_answer(const proto::Envelope& hello);
  // A monitor event: a failed handshake throws; connections made or retried are counted.
  void on_event(const zmq::message_t& event);
  // Watches `events` of the socket (replacing the watch before, if any).
  void monitor(int events);
  // [Shutdown notice]: records it and returns true if `frames` is the executor's.
  bool is_shutdown_notice(const std::vector<zmq::message_t>& frames);
  // Reads every message waiting now (the first after up to `wait`): the shutdown notice is
  // recorded, the others kept for receive().
  void take_waiting(std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  // [Executor restart]: records why the connection is lost (the first reason stays).
  void lose(std::string why);

  std::string endpoint_;
  int timeout_ms_;
  int connect_timeout_ms_;
  bool with_keys_;
  bool heard_ = false;      // an answer came: the connection is up, the monitor watches handshakes and breaks only
  bool connected_ = false;  // a connection was made (before the first answer)
  bool greeted_ = false;    // ZeroMQ's handshake succeeded (before the first answer)
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();  // the socket's making
  int retries_ = 0;   // connections refused or broken off before the first answer
  int monitors_ = 0;  // monitor endpoints used, for a fresh name each
  std::string lost_;  // [Executor restart]: why the connection is lost; every call throws it since
  std::deque<std::vector<zmq::message_t>> held_;  // messages executor_gone() took past
  zmq::context_t context_{1};
  zmq::socket_t socket_{context_, zmq::socket_type::dealer};
  zmq::socket_t monitor_{context_, zmq::socket_type::pair};
  UniqueFd link_;
  std::vector<UniqueFd> descriptors_;
};

// Asks the executor at `endpoint` for its statistics, an operator request (with keys, `keys` must
// be an operator's). Throws the executor's refusal, or a timeout naming it.
proto::Stats request_stats(const std::string& endpoint, int timeout_ms, const ClientKeys& keys = {});

// [Traces] (base_executor/tracing.h): starts the executor's trace, to be written to `path` on its
// host (start), or stops it (start false, path unused) and returns where it was written. An operator
// request, as request_stats; throws the executor's refusal.
proto::TraceWritten request_trace(const std::string& endpoint, int timeout_ms, bool start, const std::string& path = "",
                                  const ClientKeys& keys = {});

}  // namespace symbiosis
