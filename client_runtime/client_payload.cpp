#include "client_runtime/client_payload.h"

#include <c10/util/Exception.h>

#include <cstring>

#include "client_runtime/client_transport.h"
#include "transport/call_ring.h"
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
  bool fits(uint64_t bytes) const override { return bytes <= capacity_; }

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
// "cuda-ipc": a cudaMalloc'd buffer on the client's GPU, which is the executor's GPU. Calls are
// ordered through the control segment's flags ([Stream-ordered hand-off] in
// transport/call_ring.h), or, with headers over ZeroMQ, through two interprocess events: the
// client records its event after writing an input; the executor's stream waits on it, and records
// the executor's event after writing the result, on which the client's stream waits before reading.
class CudaIpcPayload : public RegisteredBuffer {
 public:
  CudaIpcPayload(ControlSocket& socket, int device)
      : RegisteredBuffer(socket), device_(device), client_event_(cuda::InterprocessEvent::create(device)) {}

  ~CudaIpcPayload() override {
    // The GPU must be done with the buffer and the flags before they go.
    try {
      if (stream_ != nullptr) cuda::synchronize_stream(stream_);
    } catch (const c10::Error&) {
    }
  }

  void send_input(const at::Tensor& x, uint64_t offset) override {
    const at::Device gpu(at::kCUDA, device_);
    const auto input = x.device() == gpu ? x : x.to(gpu);  // contiguous, the layer's dtype (VirtLayer)
    void* stream = use_stream();
    cuda::copy_on_stream(static_cast<char*>(buffer_.data()) + offset, input.data_ptr(), input.nbytes(), stream);
    if (inputs_ready_ == nullptr) client_event_.record(stream);
  }

  at::Tensor receive_output(uint64_t offset, at::ScalarType dtype, at::IntArrayRef shape, at::Device device) override {
    void* stream = use_stream();
    if (inputs_ready_ == nullptr) executor_event_.make_stream_wait(stream);
    auto out = at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    cuda::copy_on_stream(out.data_ptr(), static_cast<const char*>(buffer_.data()) + offset, out.nbytes(), stream);
    return device == out.device() ? out : out.to(device);
  }

  bool order_through(shm::SharedMemory& control) override {
    control_pin_ = cuda::PinnedRange(control.data(), control.size(), /*mapped=*/true);
    auto* block = static_cast<shm::ControlBlock*>(control.data());
    results_ready_ = control_pin_.device_pointer(&block->results_ready);
    inputs_ready_ = control_pin_.device_pointer(&block->inputs_ready);
    return true;
  }
  // On the stream send_input just used.
  void announce_input(uint32_t sequence) override { cuda::write_value_on_stream(stream_, inputs_ready_, sequence); }
  void await_result(uint32_t sequence) override { cuda::wait_value_on_stream(stream_, results_ready_, sequence); }

 protected:
  void allocate(uint64_t bytes) override { next_ = cuda::DeviceBuffer::allocate(device_, bytes); }
  void describe(proto::RegisterBuffer* r) override {
    r->set_cuda_ipc_handle(next_.ipc_handle());
    r->set_client_event(client_event_.ipc_handle());
  }
  void registered(const proto::BufferRegistered& answer) override {
    if (!executor_event_.valid()) executor_event_ = cuda::InterprocessEvent::open(device_, answer.executor_event());
    // Work of this stream may still read the old buffer.
    if (buffer_.data() != nullptr) cuda::synchronize_stream(use_stream());
    buffer_ = std::move(next_);
  }

 private:
  // The current stream, ordered after the stream of the previous call if it was another (a call's
  // copies reuse the buffer regions the previous call's copies and flags guard).
  void* use_stream() {
    void* stream = cuda::current_stream(device_);
    if (stream_ != nullptr && stream_ != stream) cuda::stream_after(stream, stream_);
    stream_ = stream;
    return stream;
  }

  int device_;
  cuda::InterprocessEvent client_event_, executor_event_;
  cuda::DeviceBuffer buffer_, next_;
  void* stream_ = nullptr;  // cudaStream_t of the last call
  cuda::PinnedRange control_pin_;
  void* inputs_ready_ = nullptr;  // GPU addresses of the control block's flags, once ordering through them
  void* results_ready_ = nullptr;
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
