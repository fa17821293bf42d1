#include "client_runtime/client_payload.h"

#include <c10/util/Exception.h>

#include <cstring>

#include "client_runtime/client_transport.h"
#include "transport/cuda_ipc.h"
#include "transport/shared_memory.h"

namespace symbiosis {
namespace {

constexpr uint64_t kInitialBufferBytes = uint64_t{4} << 20;

// A payload buffer registered with the executor: grows by registering a new, larger buffer (the
// old one is released only after the executor has let go of it).
class RegisteredBuffer : public ClientPayload {
 public:
  explicit RegisteredBuffer(ControlSocket& socket) : socket_(socket) {}

  void reserve(uint64_t bytes) override {
    if (bytes <= capacity_) return;
    uint64_t size = std::max<uint64_t>(kInitialBufferBytes, capacity_ * 2);
    while (size < bytes) size *= 2;
    allocate(size);
    proto::Envelope env;
    auto* r = env.mutable_register_buffer();
    r->set_generation(generation_ + 1);
    r->set_bytes(size);
    describe(r);
    auto answer = socket_.exchange(env, "the payload buffer registration");
    TORCH_CHECK(answer.has_buffer_registered() && answer.buffer_registered().generation() == generation_ + 1,
                "executor answered a buffer registration with something else");
    registered(answer.buffer_registered());
    capacity_ = size;
    generation_++;
  }

  uint64_t generation() const override { return generation_; }

 protected:
  // Makes a new buffer of `bytes` the current one (the previous stays alive until registered()).
  virtual void allocate(uint64_t bytes) = 0;
  virtual void describe(proto::RegisterBuffer* registration) = 0;
  // The executor has mapped the new buffer and released the old one.
  virtual void registered(const proto::BufferRegistered& answer) = 0;

 private:
  ControlSocket& socket_;
  uint64_t capacity_ = 0;
  uint64_t generation_ = 0;
};

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
  void allocate(uint64_t bytes) override { next_ = shm::SharedMemory::create("symbiosis-payload", bytes); }
  void describe(proto::RegisterBuffer* r) override { r->set_shm_name(next_.name()); }
  void registered(const proto::BufferRegistered&) override {
    next_.unlink();  // both sides have it mapped: the memory goes with the last mapping
    memory_ = std::move(next_);
  }

 private:
  shm::SharedMemory memory_, next_;
};

#ifdef SYMBIOSIS_WITH_CUDA
// "cuda-ipc": a cudaMalloc'd buffer on the client's GPU, which is the executor's GPU. The client
// records its event after writing an input; the executor's stream waits on it, and records the
// executor's event after writing the result, on which the client's stream waits before reading.
class CudaIpcPayload : public RegisteredBuffer {
 public:
  CudaIpcPayload(ControlSocket& socket, int device)
      : RegisteredBuffer(socket), device_(device), client_event_(cuda::InterprocessEvent::create(device)) {}

  void send_input(const at::Tensor& x, uint64_t offset) override {
    const at::Device gpu(at::kCUDA, device_);
    const auto input = x.device() == gpu ? x : x.to(gpu);  // contiguous, the layer's dtype (VirtLayer)
    void* stream = cuda::current_stream(device_);
    cuda::copy_on_stream(static_cast<char*>(buffer_.data()) + offset, input.data_ptr(), input.nbytes(), stream);
    client_event_.record(stream);
  }

  at::Tensor receive_output(uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape, at::Device device) override {
    void* stream = cuda::current_stream(device_);
    executor_event_.make_stream_wait(stream);
    auto out = at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    cuda::copy_on_stream(out.data_ptr(), static_cast<const char*>(buffer_.data()) + offset, out.nbytes(), stream);
    return device == out.device() ? out : out.to(device);
  }

 protected:
  void allocate(uint64_t bytes) override { next_ = cuda::DeviceBuffer::allocate(device_, bytes); }
  void describe(proto::RegisterBuffer* r) override {
    r->set_cuda_ipc_handle(next_.ipc_handle());
    r->set_client_event(client_event_.ipc_handle());
  }
  void registered(const proto::BufferRegistered& answer) override {
    if (!executor_event_.valid()) executor_event_ = cuda::InterprocessEvent::open(device_, answer.executor_event());
    // Work of this stream may still read the old buffer.
    if (buffer_.data() != nullptr) cuda::synchronize_stream(cuda::current_stream(device_));
    buffer_ = std::move(next_);
  }

 private:
  int device_;
  cuda::InterprocessEvent client_event_, executor_event_;
  cuda::DeviceBuffer buffer_, next_;
};
#endif

}  // namespace

std::unique_ptr<ClientPayload> make_client_payload(const std::string& kind, const ClientOptions& options,
                                                   ControlSocket& socket) {
  if (kind == "shm") return std::make_unique<HostPayload>(socket);
  const at::Device device(options.device);
  if (kind == "cuda-ipc") {
    TORCH_CHECK(device.is_cuda(), "transport cuda-ipc needs a client on the executor's GPU; this client's device is ",
                options.device);
#ifdef SYMBIOSIS_WITH_CUDA
    return std::make_unique<CudaIpcPayload>(socket, device.has_index() ? device.index() : 0);
#else
    TORCH_CHECK(false, "transport cuda-ipc: this build of symbiosis has no CUDA");
#endif
  }
  if (kind == "nccl") return make_nccl_payload(options, socket);
  TORCH_CHECK(false, "unknown same-host transport '", kind, "' (expected shm, cuda-ipc or nccl)");
}

}  // namespace symbiosis
