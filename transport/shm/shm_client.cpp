// The client's end of the "shm" transport: a host shared-memory payload buffer the client
// creates and registers, and the executor maps.
#include <cstring>

#include "transport/client_payload.h"
#include "transport/shared_memory.h"

namespace symbiosis::shm {
namespace {

// "shm": a host shared-memory segment the client creates and the executor maps.
class HostPayload : public RegisteredBuffer {
 public:
  using RegisteredBuffer::RegisteredBuffer;

  void send_input(const at::Tensor& x, uint64_t offset) override {
    const auto host = x.device().is_cpu() ? x : x.to(at::kCPU);
    std::memcpy(static_cast<char*>(memory_.data()) + offset, host.data_ptr(), host.nbytes());
  }

  at::Tensor receive_output(uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape, at::Device device) override {
    auto out = at::empty(shape, at::TensorOptions().dtype(dtype));
    std::memcpy(out.data_ptr(), static_cast<const char*>(memory_.data()) + offset, out.nbytes());
    return device.is_cpu() ? out : out.to(device);
  }

 protected:
  void allocate(uint64_t bytes) override { next_ = shm::SharedMemory::create("payload", bytes); }
  int describe(proto::RegisterBuffer*) override { return next_.descriptor(); }
  void registered(const proto::BufferRegistered&) override { memory_ = std::move(next_); }

 private:
  shm::SharedMemory memory_, next_;
};

}  // namespace

std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options) {
  return make_payload_transport(socket, welcome, options, [&] { return std::make_unique<HostPayload>(socket); });
}

}  // namespace symbiosis::shm
