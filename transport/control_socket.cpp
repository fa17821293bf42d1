#include "transport/control_socket.h"

#include <netdb.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "transport/local_socket.h"
#include "transport/zmq_wire.h"

namespace symbiosis {

// [No silent waits]
// A client pointed at the wrong port, or at an executor that is not running, must not sit silent
// for its call timeout. Until the first answer comes, the socket's monitor reports connections
// made, retried and broken off ([Handshake diagnosis] says what a failed handshake was): where
// every attempt is refused (nothing listens there) the client gives up after kRefusedGiveUp,
// naming the endpoint; where attempts neither succeed nor fail (a host that
// drops packets) it waits up to the connect timeout. Meanwhile it says every kWaitNote what it
// waits for. Once the executor has answered, the monitor watches failed handshakes and broken-off
// connections only (other events would pile up unread while the client is idle), and an executor
// that stops says so ([Shutdown notice] in base_executor/front_door.cpp); one that dies without a
// word breaks the connection off, and a same-host client's local link with it ([Executor restart]).
namespace {
constexpr auto kRefusedGiveUp = std::chrono::seconds(2);
constexpr auto kWaitNote = std::chrono::seconds(2);           // while connecting
constexpr auto kCallWaitNote = std::chrono::seconds(10);      // while a call waits
constexpr auto kNoticeWait = std::chrono::milliseconds(100);  // for a shutdown notice, once the connection broke
constexpr int kHandshakeEvents =
    ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
constexpr int kConnectEvents = ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
constexpr int kConnectedEvents = kHandshakeEvents | ZMQ_EVENT_DISCONNECTED;

// [Handshake diagnosis]
// A failed handshake says what was seen, never a guess. ZeroMQ's monitor is precise about some
// failures: the executor refused this client's key (HANDSHAKE_FAILED_AUTH, with the ZAP status:
// [Admission] in base_executor/admission.h), or the two ends ask for different security
// mechanisms (HANDSHAKE_FAILED_PROTOCOL, mechanism mismatch: keys on one end only). Others it
// reports only as a connection that ended during the handshake, and there an executor that
// refuses a keyless client, one that cannot decrypt what was encrypted for another key, and a
// program that is no executor at all (its metrics port, a web server) look alike. So the client
// looks once more, by hand (probe_greeting): a plain connection, the first 11 bytes of a ZeroMQ 3
// greeting, and what comes back within kProbeWait. A ZeroMQ peer answers with its own greeting,
// which names its mechanism (an executor asks for CURVE with --keys, NULL without); anything else
// is not an executor. Only that evidence makes the client say that the executor "admits only
// tenants with keys" or that the key it was given "is not that executor's". The same look tells a
// peer that accepted the connection but never answered (not even ZeroMQ's greeting) from an
// executor slow to answer. An answer that comes but is not a symbiosis message is named so.
constexpr auto kProbeWait = std::chrono::milliseconds(500);

struct PeerGreeting {
  enum class Seen {
    kUnknown,    // could not look (detail: why)
    kRefused,    // nothing listens there now
    kSilent,     // it accepted the connection and sent nothing within kProbeWait
    kClosed,     // it closed the connection without a byte
    kNotZeroMQ,  // its first bytes are not ZeroMQ's (detail: them, printable)
    kZeroMQ,     // a ZeroMQ greeting (detail: the mechanism it asks for, "" where none is named)
  };
  Seen seen = Seen::kUnknown;
  std::string detail;
};

// What `bytes` begin with, as text: its first line, at most 40 characters, other bytes as '.'.
std::string printable_start(const unsigned char* bytes, size_t size) {
  std::string text;
  for (size_t i = 0; i < size && text.size() < 40 && bytes[i] != '\r' && bytes[i] != '\n'; ++i) {
    text += bytes[i] >= 0x20 && bytes[i] < 0x7f ? static_cast<char>(bytes[i]) : '.';
  }
  return text;
}

// [Handshake diagnosis]: looks at what answers at `endpoint` (tcp:// or ipc://).
PeerGreeting probe_greeting(const std::string& endpoint, std::chrono::milliseconds wait) {
  using Seen = PeerGreeting::Seen;
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + wait;
  auto left_ms = [&] {
    return static_cast<int>(
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  sockaddr_storage address{};
  socklen_t length = 0;
  const auto scheme_end = endpoint.find("://");
  if (scheme_end == std::string::npos) return {Seen::kUnknown, "no scheme"};
  const std::string scheme = endpoint.substr(0, scheme_end);
  const std::string rest = endpoint.substr(scheme_end + 3);
  if (scheme == "tcp") {
    const std::string target = rest.substr(rest.find(';') + 1);  // past a source address, if any
    const auto colon = target.rfind(':');
    if (colon == std::string::npos) return {Seen::kUnknown, "no port"};
    std::string host = target.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(host.c_str(), target.substr(colon + 1).c_str(), &hints, &found) != 0 || found == nullptr) {
      return {Seen::kUnknown, "cannot resolve " + host};
    }
    std::memcpy(&address, found->ai_addr, found->ai_addrlen);
    length = found->ai_addrlen;
    ::freeaddrinfo(found);
  } else if (scheme == "ipc") {
    sockaddr_un local{};
    if (rest.empty() || rest.size() >= sizeof(local.sun_path)) return {Seen::kUnknown, "path too long"};
    local.sun_family = AF_UNIX;
    std::memcpy(local.sun_path, rest.data(), rest.size());
    const bool abstract = rest[0] == '@';
    if (abstract) local.sun_path[0] = '\0';
    length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + rest.size() + (abstract ? 0 : 1));
    std::memcpy(&address, &local, sizeof(local));
  } else {
    return {Seen::kUnknown, "cannot look at a " + scheme + " endpoint"};
  }
  UniqueFd fd(::socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) return {Seen::kUnknown, std::strerror(errno)};
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    if (errno == ECONNREFUSED || errno == ENOENT) return {Seen::kRefused, ""};
    if (errno != EINPROGRESS) return {Seen::kUnknown, std::strerror(errno)};
    pollfd item{fd.get(), POLLOUT, 0};
    if (::poll(&item, 1, left_ms()) <= 0) return {Seen::kUnknown, "no connection within the wait"};
    int error = 0;
    socklen_t size = sizeof(error);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &size);
    if (error == ECONNREFUSED) return {Seen::kRefused, ""};
    if (error != 0) return {Seen::kUnknown, std::strerror(error)};
  }
  // A ZeroMQ 3 greeting's signature and major version: a ZeroMQ peer answers with its greeting,
  // the mechanism's name at bytes 12 to 31.
  const unsigned char start[11] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3};
  (void)!::send(fd.get(), start, sizeof(start), MSG_NOSIGNAL);
  unsigned char answer[64];
  size_t got = 0;
  bool closed = false;
  while (got < sizeof(answer) && !(got > 0 && answer[0] != 0xff && got >= 40)) {
    pollfd item{fd.get(), POLLIN, 0};
    if (::poll(&item, 1, left_ms()) <= 0) break;
    const ssize_t n = ::recv(fd.get(), answer + got, sizeof(answer) - got, 0);
    if (n < 0 && errno == EAGAIN) continue;
    if (n <= 0) {
      closed = true;
      break;
    }
    got += static_cast<size_t>(n);
  }
  if (got == 0) return {closed ? Seen::kClosed : Seen::kSilent, ""};
  if (answer[0] != 0xff || (got >= 10 && (answer[9] & 1) == 0)) {
    return {Seen::kNotZeroMQ, printable_start(answer, got)};
  }
  if (got < 32 || answer[10] < 3) return {Seen::kZeroMQ, ""};  // no mechanism named (yet, or before ZeroMQ 3)
  const auto* name = reinterpret_cast<const char*>(answer + 12);
  return {Seen::kZeroMQ, std::string(name, ::strnlen(name, 20))};
}
}  // namespace

ControlSocket::ControlSocket(const std::string& endpoint, int timeout_ms, const ClientKeys& keys,
                             int connect_timeout_ms)
    : endpoint_(endpoint),
      timeout_ms_(timeout_ms),
      connect_timeout_ms_(connect_timeout_ms > 0 ? connect_timeout_ms : timeout_ms),
      with_keys_(!keys.executor_key.empty()) {
  wire::validate_endpoint(endpoint, "executor endpoint");
  socket_.set(zmq::sockopt::linger, 0);
  if (with_keys_) {
    socket_.set(zmq::sockopt::curve_serverkey, keys.executor_key);
    socket_.set(zmq::sockopt::curve_publickey, keys.own.public_key);
    socket_.set(zmq::sockopt::curve_secretkey, keys.own.secret_key);
  }
  // The monitor tells a refused handshake from an executor that is not there, and a port where
  // nothing listens from an executor that is slow to answer ([No silent waits]).
  monitor(kHandshakeEvents | kConnectEvents | ZMQ_EVENT_DISCONNECTED);
  try {
    socket_.connect(endpoint);
  } catch (const zmq::error_t& e) {
    TORCH_CHECK(false, "cannot connect to executor endpoint '", endpoint, "': ", e.what());
  }
}

void ControlSocket::monitor(int events) {
  const std::string monitor_endpoint = "inproc://handshake-monitor." + std::to_string(monitors_++);
  if (monitors_ > 1) zmq_socket_monitor(socket_.handle(), nullptr, 0);  // stops the watch before
  TORCH_CHECK(zmq_socket_monitor(socket_.handle(), monitor_endpoint.c_str(), events) == 0,
              "cannot monitor the executor socket: ", zmq_strerror(zmq_errno()));
  monitor_ = zmq::socket_t(context_, zmq::socket_type::pair);
  monitor_.set(zmq::sockopt::linger, 0);
  monitor_.connect(monitor_endpoint);
}

void ControlSocket::send(const proto::Envelope& envelope, const at::Tensor* payload) {
  check_not_gone();
  // Never blocks: ZeroMQ queues for a connection that is not up yet, and a full queue means the
  // executor has stopped reading.
  const auto more = payload ? zmq::send_flags::sndmore : zmq::send_flags::none;
  bool sent = socket_.send(wire::serialize(envelope), more | zmq::send_flags::dontwait).has_value();
  if (sent && payload) {
    // Once a message's first frame is queued, ZeroMQ takes the rest of it.
    auto frames = wire::tensor_frames(*payload);
    for (size_t i = 0; sent && i < frames.size(); ++i) {
      const auto last = i + 1 == frames.size() ? zmq::send_flags::none : zmq::send_flags::sndmore;
      sent = socket_.send(frames[i], last | zmq::send_flags::dontwait).has_value();
    }
  }
  if (!sent && executor_gone()) check_not_gone();  // no peer to queue for: the connection broke off
  TORCH_CHECK(sent, "executor at ", endpoint_, " is not taking messages (its queue to us is full)");
}

std::vector<zmq::message_t> ControlSocket::receive(const char* waiting_for) {
  check_not_gone();
  if (!held_.empty()) {
    auto frames = std::move(held_.front());
    held_.pop_front();
    return frames;
  }
  using Clock = std::chrono::steady_clock;
  const bool connecting = !heard_;
  const int limit_ms = connecting ? connect_timeout_ms_ : timeout_ms_;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(limit_ms);
  const auto note_every = connecting ? kWaitNote : kCallWaitNote;
  auto next_note = start + note_every;
  while (true) {
    zmq::pollitem_t items[] = {{socket_.handle(), 0, ZMQ_POLLIN, 0}, {monitor_.handle(), 0, ZMQ_POLLIN, 0}};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::min(deadline, next_note) - Clock::now());
    zmq::poll(items, 2, std::max(left, std::chrono::milliseconds(0)));
    if (items[1].revents & ZMQ_POLLIN) {
      auto event = wire::recv_all(monitor_);
      on_event(event.at(0));
      check_not_gone();
    }
    if (items[0].revents & ZMQ_POLLIN) {
      auto frames = wire::recv_all(socket_);
      if (is_shutdown_notice(frames)) check_not_gone();
      if (!heard_) {
        heard_ = true;
        monitor(kConnectedEvents);
      }
      return frames;
    }
    const auto now = Clock::now();
    const auto waited_s = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
    TORCH_CHECK(!connecting || connected_ || retries_ == 0 || now - start < kRefusedGiveUp, "no executor answers at ",
                endpoint_, ": connections to it are refused (tried for ", waited_s,
                " s; is the executor running, and is this the right port?)");
    if (connecting && connected_ && !greeted_ && now >= deadline) {
      // [Handshake diagnosis]: a peer that accepted the connection but never finished ZeroMQ's
      // handshake; an executor says its greeting at once.
      const auto greeting = probe_greeting(endpoint_, kProbeWait);
      TORCH_CHECK(greeting.seen != PeerGreeting::Seen::kSilent, "the peer at ", endpoint_,
                  " accepted the connection but did not answer ", waiting_for, " within ", limit_ms,
                  " ms, not even with ZeroMQ's greeting: it is not a symbiosis executor (is this the right port?)");
      TORCH_CHECK(greeting.seen != PeerGreeting::Seen::kNotZeroMQ, "the peer at ", endpoint_,
                  " is not a symbiosis executor: it did not answer ", waiting_for, " within ", limit_ms,
                  " ms, and it answers a new connection with bytes that are not ZeroMQ (\"", greeting.detail,
                  "\"); is this the right port?");
    }
    TORCH_CHECK(now < deadline, "executor at ", endpoint_, " did not answer ", waiting_for, " within ", limit_ms,
                " ms (is it running and reachable?)");
    if (now >= next_note) {
      if (connecting) {
        spdlog::warn(
            "waiting for the executor at {}: no answer to {} after {} s (is it running, and is this the "
            "right port?)",
            endpoint_, waiting_for, waited_s);
      } else {
        spdlog::info("waiting for the executor at {} to answer {}: {} s so far (gives up after {} ms)", endpoint_,
                     waiting_for, waited_s, limit_ms);
      }
      next_note += note_every;
    }
  }
}

void ControlSocket::on_event(const zmq::message_t& event) {
  uint16_t kind = 0;
  if (event.size() < 6) return;
  std::memcpy(&kind, event.data(), 2);
  if (kind == ZMQ_EVENT_CONNECTED || kind == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
    connected_ = true;
    if (kind == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) greeted_ = true;
  } else if (kind == ZMQ_EVENT_DISCONNECTED && !heard_) {
    // [Handshake diagnosis]: before the first answer.
    TORCH_CHECK(!greeted_, "the connection to the executor at ", endpoint_,
                " broke off before it answered (it stopped, crashed or is restarting)");
    handshake_broke_off("the connection ended during the handshake");
  } else if (kind == ZMQ_EVENT_CONNECT_RETRIED) {
    retries_++;
  } else if (kind == ZMQ_EVENT_DISCONNECTED && heard_) {
    // What came before the break: a shutdown notice among it says why better. ZeroMQ may report the
    // break before it hands over the messages that preceded it: they get a moment.
    take_waiting(kNoticeWait);
    lose("the connection to the executor at " + endpoint_ + " broke off (it stopped, crashed or is restarting)");
  } else if (kind & kHandshakeEvents) {
    check_handshake(event);
  }
}

bool ControlSocket::is_shutdown_notice(const std::vector<zmq::message_t>& frames) {
  // An Envelope whose body is shutting_down (field 18) begins with its tag, 0x92 0x01: other
  // messages are not parsed twice.
  if (frames.empty() || frames[0].size() < 2) return false;
  const auto* bytes = static_cast<const uint8_t*>(frames[0].data());
  if (bytes[0] != 0x92 || bytes[1] != 0x01) return false;
  proto::Envelope env;
  if (!wire::parse(frames[0], &env) || !env.has_shutting_down()) return false;
  const std::string& reason = env.shutting_down().reason();
  lose("the executor at " + endpoint_ + " shut down" + (reason.empty() ? "" : " (" + reason + ")"));
  return true;
}

void ControlSocket::lose(std::string why) {
  if (!lost_.empty()) return;
  lost_ = std::move(why);
  spdlog::warn("{}", lost_);
}

bool ControlSocket::link_closed() const {
  if (!link_) return false;
  pollfd item{link_.get(), POLLIN, 0};
  if (::poll(&item, 1, 0) <= 0) return false;
  if (item.revents & (POLLHUP | POLLERR)) return true;
  char byte = 0;
  return ::recv(link_.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void ControlSocket::take_waiting(std::chrono::milliseconds wait) {
  while (lost_.empty()) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, wait);
    wait = std::chrono::milliseconds(0);  // only the first look waits
    if (!(item.revents & ZMQ_POLLIN)) return;
    auto frames = wire::recv_all(socket_);
    if (!is_shutdown_notice(frames)) held_.push_back(std::move(frames));
  }
}

bool ControlSocket::executor_gone() {
  if (!lost_.empty()) return true;
  zmq::pollitem_t item{monitor_.handle(), 0, ZMQ_POLLIN, 0};
  while (lost_.empty() && zmq::poll(&item, 1, std::chrono::milliseconds(0)) > 0) {
    auto event = wire::recv_all(monitor_);
    on_event(event.at(0));
  }
  take_waiting();
  if (lost_.empty() && link_closed()) {
    lose("the executor at " + endpoint_ + " closed this client's local link (it stopped, crashed or is restarting)");
  }
  return !lost_.empty();
}

void ControlSocket::check_not_gone() const {
  if (!lost_.empty()) throw ExecutorLost({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, lost_);
}

void ControlSocket::check_handshake(const zmq::message_t& event) {
  uint16_t kind = 0;
  uint32_t value = 0;
  if (event.size() < 6) return;
  std::memcpy(&kind, event.data(), 2);
  std::memcpy(&value, static_cast<const char*>(event.data()) + 2, 4);
  // [Handshake diagnosis]
  if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
    heard_ = true;  // the executor's answer: trying again gets the same ([Executor restart])
    TORCH_CHECK(false, "the executor at ", endpoint_, " refused this client's key at the handshake (ZAP ", value,
                value == 400 ? ": not admitted or revoked" : "",
                "): its operator admits a tenant by copying its NAME.pub into the executor's keys folder, tenants/ "
                "(and not revoked/); docs/operating.md, Keys");
  }
  if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
    TORCH_CHECK(with_keys_, "executor at ", endpoint_,
                " admits only tenants with keys: give the client the executor's public key and this tenant's key "
                "pair (ClientOptions::executor_key and key_file; docs/operating.md)");
    TORCH_CHECK(false, "executor at ", endpoint_,
                " takes no keys (it was started without --keys), but this client was given some");
  }
  if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
    char code[16];
    std::snprintf(code, sizeof(code), "0x%08x", value);
    handshake_broke_off(std::string("the handshake broke off (ZeroMQ protocol error ") + code + ")");
  }
  handshake_broke_off(std::string("the connection ended during the handshake (") +
                      (value != 0 ? std::strerror(static_cast<int>(value)) : "no detail") + ")");
}

void ControlSocket::handshake_broke_off(const std::string& how) {
  // [Handshake diagnosis]: what answers there now says which it was.
  const auto took_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started_).count();
  const auto greeting = probe_greeting(endpoint_, kProbeWait);
  using Seen = PeerGreeting::Seen;
  const std::string not_executor = "the peer at " + endpoint_ + " is not a symbiosis executor: " + how;
  switch (greeting.seen) {
    case Seen::kZeroMQ:
      if (greeting.detail == "CURVE") {
        TORCH_CHECK(with_keys_, "executor at ", endpoint_,
                    " admits only tenants with keys: give the client the executor's public key and this tenant's key "
                    "pair (ClientOptions::executor_key and key_file; docs/operating.md)");
        TORCH_CHECK(took_ms >= 1000, "executor at ", endpoint_, " broke off the encrypted handshake (", how,
                    "): the executor key this client was given is not that executor's");
        TORCH_CHECK(false, "executor at ", endpoint_, " broke off the encrypted handshake after ", took_ms, " ms (",
                    how,
                    "): the executor key this client was given is not that executor's, or the executor did not "
                    "finish the handshake within its handshake interval (is it overloaded?)");
      }
      TORCH_CHECK(greeting.detail != "NULL" || !with_keys_, "executor at ", endpoint_,
                  " takes no keys (it was started without --keys), but this client was given some");
      TORCH_CHECK(false, "the ZeroMQ peer at ", endpoint_, " ended the handshake (", how, "); it asks for ",
                  greeting.detail.empty() ? std::string("no security mechanism by name")
                                          : "security mechanism " + greeting.detail,
                  ", and this client ", with_keys_ ? "encrypts with keys" : "has no keys",
                  ": it is not a symbiosis executor, or it stopped meanwhile (is this the right port?)");
    case Seen::kNotZeroMQ:
      TORCH_CHECK(false, not_executor, ", and it answers a new connection with bytes that are not ZeroMQ (\"",
                  greeting.detail, "\"); is this the right port? (an executor's metrics port, for one, speaks HTTP)");
    case Seen::kClosed:
      TORCH_CHECK(false, not_executor, ", and it closes a new connection without a byte (is this the right port?)");
    case Seen::kSilent:
      TORCH_CHECK(false, not_executor,
                  ", and it says nothing on a new connection, not even ZeroMQ's greeting (is this the right port?)");
    case Seen::kRefused:
      TORCH_CHECK(false, "the peer at ", endpoint_, ": ", how,
                  ", and it now refuses connections: it stopped (is the executor restarting?)");
    case Seen::kUnknown: break;
  }
  TORCH_CHECK(false, "the peer at ", endpoint_, ": ", how, " (what answers there could not be told: ", greeting.detail,
              ")");
}

proto::Envelope ControlSocket::handshake_answer(const proto::Envelope& hello) {
  send(hello);
  const auto frames = receive("the handshake");
  // [Handshake diagnosis]: an answer that is not a symbiosis message comes from something else.
  proto::Envelope env;
  if (frames.empty() || !wire::parse(frames[0], &env) || env.body_case() == proto::Envelope::BODY_NOT_SET) {
    const size_t size = frames.empty() ? 0 : frames[0].size();
    TORCH_CHECK(
        false, "the peer at ", endpoint_, " is not a symbiosis executor: it answered the handshake with ",
        frames.size(), " frame(s) that are not a symbiosis message (the first of ", size, " bytes: \"",
        frames.empty() ? std::string() : printable_start(static_cast<const unsigned char*>(frames[0].data()), size),
        "\"); is this the right endpoint?");
  }
  return parse_or_throw(frames);
}

proto::Welcome ControlSocket::handshake(proto::Envelope hello) {
  auto answer = handshake_answer(hello);
  if (answer.has_prove_host()) {
    auto link = local::prove(answer.prove_host(), timeout_ms_);
    if (link.is_ok()) {
      link_ = std::move(link.value().connection);
      descriptors_ = std::move(link.value().descriptors);
      answer = parse_or_throw(receive("the handshake"));
    } else {
      const std::string& asked = hello.hello().transport();
      TORCH_CHECK(asked.empty() || asked == "auto", "executor at ", endpoint_, " offered transport ", asked,
                  ", but this client could not prove it shares the executor's host: ", link.status().message());
      spdlog::warn("executor at {}: no same-host transport, using tcp: {}", endpoint_, link.status().message());
      hello.mutable_hello()->set_transport("tcp");
      answer = handshake_answer(hello);
    }
  }
  TORCH_CHECK(answer.has_welcome(), "executor answered the handshake with something other than Welcome");
  return std::move(*answer.mutable_welcome());
}

void ControlSocket::send_setup(const proto::Envelope& envelope, int descriptor) {
  if (!link_) {
    TORCH_CHECK(descriptor < 0, "internal: a descriptor to hand over without a local link");
    return send(envelope);
  }
  try {
    local::send(link_.get(), envelope, descriptor >= 0 ? std::vector<int>{descriptor} : std::vector<int>{});
  } catch (const c10::Error&) {
    if (executor_gone()) check_not_gone();  // the executor closed the link: ExecutorLost, not a set-up failure
    throw;
  }
}

proto::Envelope ControlSocket::exchange_setup(const proto::Envelope& envelope, const char* waiting_for,
                                              int descriptor) {
  send_setup(envelope, descriptor);
  return parse_or_throw(receive(waiting_for));
}

proto::Envelope ControlSocket::parse_or_throw(const std::vector<zmq::message_t>& frames) {
  proto::Envelope env;
  TORCH_CHECK(!frames.empty() && wire::parse(frames[0], &env), "executor sent a message that does not parse");
  if (env.has_error()) throw_executor_error(env.error().code(), env.error().message());
  return env;
}

[[noreturn]] void throw_executor_error(proto::ErrorCode code, const std::string& message, const std::string& on,
                                       bool can_send_again) {
  std::string what =
      "executor error (" + proto::ErrorCode_Name(code) + ")" + (on.empty() ? "" : " on " + on) + ": " + message;
  if (code == proto::RESOURCE_EXHAUSTED && can_send_again) {
    throw ExecutorBusy({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(what));
  }
  TORCH_CHECK(false, what);
}

proto::Stats request_stats(const std::string& endpoint, int timeout_ms, const ClientKeys& keys) {
  ControlSocket socket(endpoint, timeout_ms, keys);
  proto::Envelope request;
  request.mutable_stats_request();
  auto answer = socket.exchange(request, "a statistics request");
  TORCH_CHECK(answer.has_stats(), "executor answered a statistics request with something else");
  return answer.stats();
}

proto::TraceWritten request_trace(const std::string& endpoint, int timeout_ms, bool start, const std::string& path,
                                  const ClientKeys& keys) {
  ControlSocket socket(endpoint, timeout_ms, keys);
  proto::Envelope request;
  request.mutable_trace_request()->set_start(start);
  request.mutable_trace_request()->set_path(path);
  auto answer = socket.exchange(request, start ? "the start of a trace" : "the written trace");
  TORCH_CHECK(answer.has_trace_written(), "executor answered a trace request with something else");
  return answer.trace_written();
}

proto::Envelope ControlSocket::exchange(const proto::Envelope& envelope, const char* waiting_for) {
  send(envelope);
  return parse_or_throw(receive(waiting_for));
}

}  // namespace symbiosis
