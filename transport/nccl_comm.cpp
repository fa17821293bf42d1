#include "transport/nccl_comm.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <thread>

#ifdef SYMBIOSIS_WITH_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

// One checking macro for NCCL: file, line, the call, and NCCL's own error string.
#define SYMBIOSIS_NCCL_CHECK(call)                                                                        \
  do {                                                                                                    \
    const ncclResult_t symbiosis_nccl_status = (call);                                                    \
    TORCH_CHECK(symbiosis_nccl_status == ncclSuccess || symbiosis_nccl_status == ncclInProgress, __FILE__, \
                ":", __LINE__, ": ", #call, " failed: ", ncclGetErrorString(symbiosis_nccl_status));      \
  } while (0)
#endif

namespace symbiosis::nccl {

#ifndef SYMBIOSIS_WITH_NCCL

bool nccl_available() { return false; }

#else

bool nccl_available() { return true; }

namespace {

ncclDataType_t to_nccl(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    default: TORCH_CHECK(false, "NCCL transport: dtype ", dtype, " cannot travel (float32, bfloat16 or float16)");
  }
}

ncclComm_t as_comm(void* comm) { return static_cast<ncclComm_t>(comm); }

}  // namespace

std::string new_unique_id() {
  ncclUniqueId id;
  SYMBIOSIS_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

Communicator::Communicator(const std::string& unique_id, int rank, int device) : device_(device) {
  TORCH_CHECK(unique_id.size() == sizeof(ncclUniqueId), "NCCL unique id has ", unique_id.size(), " bytes, expected ",
              sizeof(ncclUniqueId));
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  ncclComm_t comm = nullptr;
  const ncclResult_t status = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
  cudaSetDevice(previous);
  TORCH_CHECK(status == ncclSuccess || status == ncclInProgress, "NCCL: cannot start joining the 2-rank communicator",
              " as rank ", rank, " on cuda:", device, ": ", ncclGetErrorString(status));
  comm_ = comm;
}

Communicator::~Communicator() { abort(); }

// Non-blocking NCCL may still be enqueueing (a first send or receive also connects the peers):
// poll until done. False when `deadline` passed first.
bool Communicator::finish_enqueue(const char* what, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    SYMBIOSIS_NCCL_CHECK(ncclCommGetAsyncError(as_comm(comm_), &state));
    if (state == ncclSuccess) return true;
    TORCH_CHECK(state == ncclInProgress, "NCCL ", what, " failed: ", ncclGetErrorString(state), " (",
                ncclGetLastError(as_comm(comm_)), ")");
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
}

bool Communicator::ready() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!aborted_, "NCCL communicator was aborted");
  ncclResult_t state = ncclSuccess;
  SYMBIOSIS_NCCL_CHECK(ncclCommGetAsyncError(as_comm(comm_), &state));
  TORCH_CHECK(state == ncclSuccess || state == ncclInProgress, "NCCL: joining the communicator failed: ",
              ncclGetErrorString(state));
  return state == ncclSuccess;
}

void Communicator::wait_ready(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) {
      abort();
      TORCH_CHECK(false, "NCCL: the peer did not join the communicator within ", timeout.count(), " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Communicator::enqueue(bool send, const at::Tensor& t, int peer, void* stream) {
  const char* what = send ? "send" : "receive";
  const auto deadline = std::chrono::steady_clock::now() + kEnqueueTimeout;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!aborted_, "NCCL ", what, ": the communicator was aborted (the peer left or timed out)");
    auto* s = static_cast<cudaStream_t>(stream);
    const auto type = to_nccl(t.scalar_type());
    SYMBIOSIS_NCCL_CHECK(send ? ncclSend(t.data_ptr(), t.numel(), type, peer, as_comm(comm_), s)
                              : ncclRecv(t.data_ptr(), t.numel(), type, peer, as_comm(comm_), s));
    if (finish_enqueue(what, deadline)) return;
  }
  abort();
  TORCH_CHECK(false, "NCCL ", what, " could not be enqueued within ", kEnqueueTimeout.count(),
              " ms (the peer is not answering); the communicator was aborted");
}

void Communicator::connect(int peer, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto out = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  auto in = at::empty_like(out);
  // The stream must belong to the communicator's GPU, whichever device is current here.
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaStream_t stream = nullptr;
  const cudaError_t created = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaSetDevice(previous);
  TORCH_CHECK(created == cudaSuccess, "NCCL connect: cannot create a stream on cuda:", device_, ": ",
              cudaGetErrorString(created));
  bool done = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!aborted_, "NCCL connect: the communicator was aborted");
    SYMBIOSIS_NCCL_CHECK(ncclGroupStart());
    SYMBIOSIS_NCCL_CHECK(ncclSend(out.data_ptr(), 1, ncclFloat32, peer, as_comm(comm_), stream));
    SYMBIOSIS_NCCL_CHECK(ncclRecv(in.data_ptr(), 1, ncclFloat32, peer, as_comm(comm_), stream));
    SYMBIOSIS_NCCL_CHECK(ncclGroupEnd());
    done = finish_enqueue("connect", deadline);
  }
  while (done && cudaStreamQuery(stream) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) done = false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (!done) abort();  // ends the kernels, so the stream can go
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  TORCH_CHECK(done, "NCCL: the peer did not connect within ", timeout.count(), " ms; the communicator was aborted");
}

void Communicator::send(const at::Tensor& t, int peer, void* stream) { enqueue(true, t, peer, stream); }
void Communicator::recv(const at::Tensor& t, int peer, void* stream) { enqueue(false, t, peer, stream); }

void Communicator::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_ || comm_ == nullptr) return;
  aborted_ = true;
  ncclCommAbort(as_comm(comm_));
  comm_ = nullptr;
}

bool Communicator::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

#endif  // SYMBIOSIS_WITH_NCCL

}  // namespace symbiosis::nccl
