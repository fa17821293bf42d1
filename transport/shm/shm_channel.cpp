// The executor's end of the "shm" transport: the client's host shared-memory payload buffer,
// mapped here ([Registered buffers] in transport/channel.h).
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "common/cuda.h"
#include "transport/channel.h"
#include "transport/transport.h"
#include "transport/shared_memory.h"

namespace symbiosis::shm {
namespace {

// "shm": the client's host shared-memory segment. On a GPU executor it is pinned, so inputs and
// results move by DMA without a staging copy.
class HostShmChannel : public RegisteredBufferChannel {
 public:
  HostShmChannel(uint64_t client_id, at::Device device)
      : RegisteredBufferChannel(TransportKind::kShm, client_id), device_(device) {}

 protected:
  void map(const proto::RegisterBuffer& r, UniqueFd segment, proto::BufferRegistered*) override {
    TORCH_CHECK(segment, "RegisterBuffer for an shm client comes with its segment's descriptor on the local socket");
    auto memory = shm::SharedMemory::map_descriptor(std::move(segment), r.bytes(), "payload");
#ifdef SYMBIOSIS_WITH_CUDA
    pinned_ = cuda::PinnedRange();
    if (device_.is_cuda()) {
      try {
        pinned_ = cuda::PinnedRange(memory.data(), memory.size());
      } catch (const c10::Error& e) {
        spdlog::warn("client {}: payload buffer not pinned, copies will be synchronous: {}", client_id(),
                     e.what_without_backtrace());
      }
    }
#endif
    memory_ = std::move(memory);
  }
  bool memory_faulted() const override { return memory_.faulted(); }
  void* base() const override { return memory_.data(); }
  size_t size() const override { return memory_.size(); }
  at::TensorOptions view_options() const override { return at::TensorOptions(); }

 private:
  at::Device device_;
#ifdef SYMBIOSIS_WITH_CUDA
  cuda::PinnedRange pinned_;  // declared before memory_: unpinned before unmapped
#endif
  shm::SharedMemory memory_;
};

// Host shared memory is all shm needs: always (pinned on a GPU executor where CUDA allows).
bool available() { return true; }

}  // namespace

std::shared_ptr<Channel> make_channel(const ChannelContext& context) {
  return std::make_shared<HostShmChannel>(context.client_id, context.device);
}

// The client's end (shm_client.cpp).
std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options);

// [Transports]: this transport's row in transport.cpp's table.
extern const TransportPlugin kPlugin{TransportKind::kShm, &available, &make_channel, &make_client};

}  // namespace symbiosis::shm
