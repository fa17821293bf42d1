#include "transport/local_socket.h"

#include <c10/util/Exception.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace symbiosis::local {
namespace {

std::string error_text() { return std::strerror(errno); }

// An abstract-namespace address: a leading NUL, then the name (no file, gone with the socket).
sockaddr_un address_of(const std::string& name, socklen_t* length) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  TORCH_CHECK(name.size() + 1 < sizeof(address.sun_path), "local socket name too long");
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return address;
}

std::string random_hex(size_t bytes) {
  std::random_device random;
  static const char* digits = "0123456789abcdef";
  std::string text;
  for (size_t i = 0; i < bytes; ++i) {
    const auto byte = static_cast<unsigned>(random()) & 0xff;
    text += digits[byte >> 4];
    text += digits[byte & 0xf];
  }
  return text;
}

}  // namespace

Listener::Listener() : name_("symbiosis-" + std::to_string(::getpid()) + "-" + random_hex(8)) {
  fd_ = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  TORCH_CHECK(fd_, "cannot make the executor's local socket: ", error_text());
  socklen_t length = 0;
  const auto address = address_of(name_, &length);
  TORCH_CHECK(
      ::bind(fd_.get(), reinterpret_cast<const sockaddr*>(&address), length) == 0 && ::listen(fd_.get(), 64) == 0,
      "cannot listen on the executor's local socket: ", error_text());
}

UniqueFd Listener::accept() { return UniqueFd(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC)); }

PeerCredentials peer_credentials(int fd) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  TORCH_CHECK(::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0,
              "cannot read the local peer's credentials: ", error_text());
  return {credentials.pid, credentials.uid};
}

StatusOr<UniqueFd> connect(const std::string& name) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) return Status(StatusCode::kInternal, "cannot make a local socket: " + error_text());
  socklen_t length = 0;
  const auto address = address_of(name, &length);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  "cannot reach the executor's local socket (" + error_text() + "): this process is not on its host");
  }
  return fd;
}

void send(int fd, const proto::Envelope& envelope, const std::vector<int>& descriptors) {
  const std::string bytes = envelope.SerializeAsString();
  TORCH_CHECK(bytes.size() <= kMaxMessageBytes, "a local-socket message of ", bytes.size(), " bytes (at most ",
              kMaxMessageBytes, ")");
  TORCH_CHECK(descriptors.size() <= kMaxDescriptors, "too many descriptors for one message");
  iovec part{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr message{};
  message.msg_iov = &part;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)] = {};
  if (!descriptors.empty()) {
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * descriptors.size());
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * descriptors.size());
    std::memcpy(CMSG_DATA(header), descriptors.data(), sizeof(int) * descriptors.size());
  }
  ssize_t sent;
  do {
    sent = ::sendmsg(fd, &message, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  TORCH_CHECK(sent == static_cast<ssize_t>(bytes.size()), "cannot send on the local socket: ", error_text());
}

StatusOr<std::optional<Message>> receive(int fd) {
  std::string bytes(kMaxMessageBytes, '\0');
  iovec part{bytes.data(), bytes.size()};
  msghdr message{};
  message.msg_iov = &part;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)] = {};
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = ::recvmsg(fd, &message, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got == 0) return std::optional<Message>();
  if (got < 0) return Status(StatusCode::kFailedPrecondition, "the local socket failed: " + error_text());
  Message result;
  // Descriptors are owned at once, so none leaks whatever is wrong with the message.
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int descriptor;
      std::memcpy(&descriptor, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      result.descriptors.emplace_back(descriptor);
    }
  }
  if (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    return Status(StatusCode::kResourceExhausted, "a local-socket message over " + std::to_string(kMaxMessageBytes) +
                                                      " bytes or " + std::to_string(kMaxDescriptors) + " descriptors");
  }
  if (!result.envelope.ParseFromArray(bytes.data(), static_cast<int>(got))) {
    return Status(StatusCode::kMalformed, "a local-socket message that is not a symbiosis Envelope");
  }
  return std::optional<Message>(std::move(result));
}

bool readable(int fd, int timeout_ms) {
  pollfd item{fd, POLLIN, 0};
  return ::poll(&item, 1, timeout_ms) > 0;
}

StatusOr<Link> prove(const proto::ProveHost& challenge, int timeout_ms) {
  auto connection = connect(challenge.local_socket());
  if (!connection.is_ok()) return connection.status();
  Link link{std::move(connection).value(), {}};
  proto::Envelope prove;
  prove.mutable_prove()->set_token(challenge.token());
  send(link.connection.get(), prove);
  if (!readable(link.connection.get(), timeout_ms)) {
    return Status(StatusCode::kFailedPrecondition,
                  "the executor did not answer the placement proof within " + std::to_string(timeout_ms) + " ms");
  }
  auto answer = receive(link.connection.get());
  if (!answer.is_ok()) return answer.status();
  if (!answer.value()) return Status(StatusCode::kFailedPrecondition, "the executor closed the local socket");
  auto& message = *answer.value();
  if (message.envelope.has_error()) {
    return Status(StatusCode::kPermissionDenied, message.envelope.error().message());
  }
  if (!message.envelope.has_proven() || message.envelope.proven().descriptors() != message.descriptors.size()) {
    return Status(StatusCode::kMalformed, "the executor answered the placement proof with something else");
  }
  link.descriptors = std::move(message.descriptors);
  return link;
}

}  // namespace symbiosis::local
