// The client's end of the "nccl" transport: tensors go GPU to GPU over a 2-rank NCCL
// communicator (the client is rank 0, the executor rank 1); headers go through the shared-memory
// control channel. Used when the client runs on another GPU than the executor's.
#include <c10/util/Exception.h>

#include "common/cuda.h"
#include "transport/client_payload.h"
#include "transport/client_transport.h"
#include "transport/nccl/nccl_comm.h"

namespace symbiosis::nccl {

#ifdef SYMBIOSIS_WITH_NCCL
namespace {

constexpr int kExecutorRank = 1;

class NcclPayload : public ClientPayload {
 public:
  NcclPayload(const ClientEndOptions& options, ControlSocket& socket) {
    const at::Device device = options.device;
    TORCH_CHECK(device.is_cuda(), "transport nccl needs a client on a GPU; this client's device is ", options.device);
    device_ = device.has_index() ? device.index() : 0;
    const std::string id = nccl::new_unique_id();
    proto::Envelope setup;
    setup.mutable_nccl_setup()->set_unique_id(id);
    socket.send_setup(setup);
    const std::chrono::milliseconds timeout(socket.timeout_ms());
    comm_ = std::make_unique<nccl::Communicator>(id, 0, device_, kExecutorRank, timeout);
    comm_->wait_ready(timeout);
    auto answer = ControlSocket::parse_or_throw(socket.receive("the NCCL set-up"));
    TORCH_CHECK(answer.has_nccl_ready(), "executor answered the NCCL set-up with something else");
  }

  void reserve(uint64_t) override {}
  uint64_t generation() const override { return 0; }

  void send_input(const at::Tensor& x, uint64_t) override {
    check_usable();
    // x is freed when the call returns; the caching allocator reuses it only in this stream's order.
    comm_->send(x.device() == at::Device(at::kCUDA, device_) ? x : x.to(at::Device(at::kCUDA, device_)), kExecutorRank,
                cuda::current_stream(device_).handle);
  }

  at::Tensor receive_output(uint64_t, at::ScalarType dtype, at::IntArrayRef shape, at::Device device) override {
    auto out = at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    comm_->recv(out, kExecutorRank, cuda::current_stream(device_).handle);
    return device == out.device() ? out : out.to(device);
  }

  // The executor refused the call without receiving its input: the send in flight can never be
  // matched, so the communicator is unusable from here on.
  void abandon_output() override { comm_->abort(); }

 private:
  void check_usable() const {
    TORCH_CHECK(!comm_->aborted(), "the nccl transport was aborted after an error; connect a new Client");
  }

  int device_ = 0;
  std::unique_ptr<nccl::Communicator> comm_;
};

}  // namespace
#endif

std::unique_ptr<ClientTransport> make_client(ControlSocket& socket, const proto::Welcome& welcome,
                                             const ClientEndOptions& options) {
#ifdef SYMBIOSIS_WITH_NCCL
  return make_payload_transport(socket, welcome, options,
                                [&] { return std::make_unique<NcclPayload>(options, socket); });
#else
  (void)socket;
  (void)welcome;
  (void)options;
  TORCH_CHECK(false, "transport nccl: this build of symbiosis has no NCCL");
#endif
}

}  // namespace symbiosis::nccl
