#include "base_executor/client_registry.h"

#include <signal.h>

#include <cerrno>

namespace symbiosis {

bool ClientRegistry::default_process_alive(int pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

ClientRegistry::ClientRegistry() : ClientRegistry(Options{}) {}

ClientRegistry::ClientRegistry(Options options) : options_(std::move(options)) {}

ClientRecord& ClientRegistry::add(const std::string& key, std::string tenant, TransportKind transport, int pid,
                                  std::shared_ptr<Channel> channel) {
  ClientRecord record{next_id_++, std::move(tenant), transport, pid, std::move(channel), options_.now()};
  return clients_.insert_or_assign(key, std::move(record)).first->second;
}

const ClientRecord* ClientRegistry::find(const std::string& key) const {
  const auto it = clients_.find(key);
  return it == clients_.end() ? nullptr : &it->second;
}

ClientRecord* ClientRegistry::seen(const std::string& key) {
  const auto it = clients_.find(key);
  if (it == clients_.end()) return nullptr;
  it->second.last_seen = options_.now();
  return &it->second;
}

std::optional<ClientRecord> ClientRegistry::remove(const std::string& key) {
  auto node = clients_.extract(key);
  if (node.empty()) return std::nullopt;
  return std::move(node.mapped());
}

std::vector<std::string> ClientRegistry::gone() const {
  std::vector<std::string> keys;
  const auto now = options_.now();
  for (const auto& [key, record] : clients_) {
    const bool channel_down = record.channel && (record.channel->broken() || record.channel->failed());
    const bool silent =
        record.pid > 0 ? !options_.process_alive(record.pid) : now - record.last_seen > options_.idle_limit;
    if (channel_down || silent) keys.push_back(key);
  }
  return keys;
}

}  // namespace symbiosis
