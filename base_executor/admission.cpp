#include "base_executor/admission.h"

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <sstream>
#include <vector>

#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";

// The roles' folders, in the order a key listed in several is given the later one.
const std::pair<const char*, Role> kFolders[] = {
    {"tenants", Role::kTenant}, {"operators", Role::kOperator}, {"revoked", Role::kRevoked}};

}  // namespace

Keys::Keys(std::filesystem::path folder) : folder_(std::move(folder)) {
  read();
  fingerprint_ = fingerprint();
}

void Keys::read() {
  TORCH_CHECK(std::filesystem::is_directory(folder_), "keys folder ", folder_.string(), " does not exist");
  const auto executor_file = folder_ / "executor.key";
  TORCH_CHECK(std::filesystem::exists(executor_file), "keys folder ", folder_.string(),
              " has no executor.key: make one with `symbiosis-ctl keygen ", (folder_ / "executor").string(), "`");
  auto executor = keys::read(executor_file, /*need_secret=*/true);
  std::map<std::string, Entry> entries;
  for (const auto& [sub, role] : kFolders) {
    const auto dir = folder_ / sub;
    if (!std::filesystem::is_directory(dir)) continue;
    for (const auto& file : std::filesystem::directory_iterator(dir)) {
      if (file.path().extension() != ".pub") continue;
      entries[keys::read(file.path(), /*need_secret=*/false).public_key] = {role, file.path().stem().string()};
    }
  }
  executor_ = std::move(executor);
  entries_ = std::move(entries);
}

std::string Keys::fingerprint() const {
  std::ostringstream text;
  std::error_code error;
  for (const auto& file : std::filesystem::recursive_directory_iterator(folder_, error)) {
    text << file.path().string() << ':' << file.last_write_time(error).time_since_epoch().count() << ':'
         << (file.is_regular_file(error) ? file.file_size(error) : 0) << '\n';
  }
  return text.str();
}

bool Keys::reload() {
  auto now = fingerprint();
  if (now == fingerprint_) return false;
  fingerprint_ = std::move(now);
  try {
    read();
  } catch (const std::exception& e) {
    spdlog::error("keys folder {} no longer reads, keeping the keys read before: {}", folder_.string(), e.what());
    return false;
  }
  spdlog::info("keys folder {} read again: {} keys listed", folder_.string(), entries_.size());
  return true;
}

const Keys::Entry& Keys::lookup(const std::string& public_key) const {
  static const Entry unknown;
  const auto it = entries_.find(public_key);
  return it == entries_.end() ? unknown : it->second;
}

bool Keys::admits_name(const std::string& name) const {
  for (const auto& [key, entry] : entries_) {
    if (entry.name == name && (entry.role == Role::kTenant || entry.role == Role::kOperator)) return true;
  }
  return false;
}

void serve_with_keys(zmq::socket_t& socket, const Keys& keys) {
  socket.set(zmq::sockopt::curve_server, true);
  socket.set(zmq::sockopt::curve_secretkey, keys.executor_pair().secret_key);
  socket.set(zmq::sockopt::curve_publickey, keys.executor_pair().public_key);
}

ZapHandler::ZapHandler(zmq::context_t& context) : socket_(context, zmq::socket_type::rep) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind(kZapEndpoint);
}

ZapHandler::Verdict ZapHandler::answer(const Keys& keys) {
  // ZAP 1.0 (rfc.zeromq.org/spec/27): version, request id, domain, address, identity, mechanism,
  // then the mechanism's credentials (CURVE: the client's 32-byte public key). The reply: version,
  // request id, status code, status text, user id, metadata. ZeroMQ tells the peer the code only.
  auto request = wire::recv_all(socket_);
  auto text = [&](size_t i) {
    return i < request.size() ? std::string(static_cast<const char*>(request[i].data()), request[i].size()) : "";
  };
  Verdict verdict;
  if (text(5) == "CURVE" && request.size() > 6 && request[6].size() == 32) {
    char z85[41];
    zmq_z85_encode(z85, static_cast<const uint8_t*>(request[6].data()), 32);
    verdict.public_key = z85;
    verdict.role = keys.lookup(verdict.public_key).role;
  }
  verdict.admitted = verdict.role == Role::kTenant || verdict.role == Role::kOperator;
  const char* status_text = verdict.admitted                 ? "OK"
                            : verdict.public_key.empty()     ? "no CURVE key"
                            : verdict.role == Role::kRevoked ? "key revoked"
                                                             : "key not admitted";
  const std::vector<std::string> reply = {
      "1.0", text(1), verdict.admitted ? "200" : "400", status_text, verdict.admitted ? verdict.public_key : "", ""};
  for (size_t i = 0; i < reply.size(); ++i) {
    socket_.send(zmq::buffer(reply[i]), i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  return verdict;
}

std::string peer_key(const zmq::message_t& frame) {
  const char* user = zmq_msg_gets(frame.handle(), "User-Id");
  return user == nullptr ? "" : user;
}

}  // namespace symbiosis
