#include "transport/nccl/nccl_comm.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <thread>

#ifdef SYMBIOSIS_WITH_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "common/cuda_check.h"
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

struct Communicator::Joining {
  std::mutex mutex;
  bool done = false;
  bool abandoned = false;  // the Communicator was aborted first: the thread tears down what it made
  std::string error;
  ncclComm_t comm = nullptr;
};

namespace {

// [NCCL connection] NCCL connects two ranks at their first send and receive, and that first
// operation does not finish enqueueing until the peer takes part. A call's send must enqueue
// before its header is pushed, so both ranks exchange one element right after joining and wait
// for it; from then on sends and receives enqueue without waiting for the peer. Returns "" or what
// failed; when the peer does not take part within `timeout`, aborts `comm` and nulls it.
std::string connect_peers(ncclComm_t& comm, int peer, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  float* buffer = nullptr;  // [0] is sent, [1] received
  cudaStream_t stream = nullptr;
  if (cudaMalloc(&buffer, 2 * sizeof(float)) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    SYMBIOSIS_CUDA_WARN(cudaFree(buffer));
    return std::string("cannot allocate the connection buffer: ") + cudaGetErrorString(cudaGetLastError());
  }
  std::string error;
  ncclResult_t status = ncclGroupStart();
  if (status == ncclSuccess) status = ncclSend(buffer, 1, ncclFloat32, peer, comm, stream);
  if (status == ncclSuccess) status = ncclRecv(buffer + 1, 1, ncclFloat32, peer, comm, stream);
  const ncclResult_t ended = ncclGroupEnd();  // always: an open group would swallow later calls
  if (status == ncclSuccess) status = ended;
  if (status != ncclSuccess) {
    error = std::string("connecting to the peer failed: ") + ncclGetErrorString(status);
  } else {
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > deadline) {
        error = "the peer did not connect within " + std::to_string(timeout.count()) + " ms";
        SYMBIOSIS_NCCL_WARN(ncclCommAbort(comm));  // ends the kernels, so the stream can go
        comm = nullptr;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  SYMBIOSIS_CUDA_WARN(cudaStreamSynchronize(stream));
  SYMBIOSIS_CUDA_WARN(cudaStreamDestroy(stream));
  SYMBIOSIS_CUDA_WARN(cudaFree(buffer));
  return error;
}

// The joining thread: blocking init, then connection; hands the communicator over (or tears it
// down when the Communicator was aborted meanwhile).
void join_and_connect(const std::shared_ptr<Communicator::Joining>& joining, const ncclUniqueId& id, int rank,
                      int device, int peer, std::chrono::milliseconds timeout) {
  std::string error;
  ncclComm_t comm = nullptr;
  if (cudaSetDevice(device) != cudaSuccess) {
    error = "cannot use cuda:" + std::to_string(device);
  } else {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    const ncclResult_t status = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
    if (status != ncclSuccess) {
      error = std::string("cannot join the 2-rank communicator as rank ") + std::to_string(rank) +
              " on cuda:" + std::to_string(device) + ": " + ncclGetErrorString(status);
      comm = nullptr;
    } else {
      error = connect_peers(comm, peer, timeout);
    }
  }
  std::lock_guard<std::mutex> lock(joining->mutex);
  if (comm != nullptr && (!error.empty() || joining->abandoned)) {
    SYMBIOSIS_NCCL_WARN(ncclCommAbort(comm));
    comm = nullptr;
  }
  joining->comm = comm;
  joining->error = error;
  joining->done = true;
}

}  // namespace

Communicator::Communicator(const std::string& unique_id, int rank, int device, int peer,
                           std::chrono::milliseconds connect_timeout)
    : joining_(std::make_shared<Joining>()) {
  TORCH_CHECK(unique_id.size() == sizeof(ncclUniqueId), "NCCL unique id has ", unique_id.size(), " bytes, expected ",
              sizeof(ncclUniqueId));
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  // Detached: it ends by itself (NCCL's bootstrap fails when the peer's process is gone, and the
  // connection has its time-out), and it shares only `joining_` with this object.
  std::thread(join_and_connect, joining_, id, rank, device, peer, connect_timeout).detach();
}

Communicator::~Communicator() { abort(); }

bool Communicator::ready() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!aborted_, "NCCL communicator was aborted");
  if (comm_ != nullptr) return true;
  std::lock_guard<std::mutex> joined(joining_->mutex);
  if (!joining_->done) return false;
  TORCH_CHECK(joining_->error.empty(), "NCCL: ", joining_->error);
  comm_ = joining_->comm;
  joining_->comm = nullptr;
  return true;
}

void Communicator::wait_ready(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) {
      abort();
      TORCH_CHECK(false, "NCCL: the peer did not join and connect within ", timeout.count(), " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Blocking mode: returns once the operation is enqueued, never waiting for the peer (connected).
void Communicator::enqueue(bool send, const at::Tensor& t, int peer, void* stream) {
  const char* what = send ? "send" : "receive";
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!aborted_, "NCCL ", what, ": the communicator was aborted (the peer left or timed out)");
  TORCH_CHECK(comm_ != nullptr, "NCCL ", what, " before the communicator is ready");
  auto* s = static_cast<cudaStream_t>(stream);
  const auto type = to_nccl(t.scalar_type());
  SYMBIOSIS_NCCL_CHECK(send ? ncclSend(t.data_ptr(), t.numel(), type, peer, as_comm(comm_), s)
                            : ncclRecv(t.data_ptr(), t.numel(), type, peer, as_comm(comm_), s));
}

void Communicator::send(const at::Tensor& t, int peer, void* stream) { enqueue(true, t, peer, stream); }
void Communicator::recv(const at::Tensor& t, int peer, void* stream) { enqueue(false, t, peer, stream); }

void Communicator::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return;
  aborted_ = true;
  if (comm_ != nullptr) {
    SYMBIOSIS_NCCL_WARN(ncclCommAbort(as_comm(comm_)));
    comm_ = nullptr;
    return;
  }
  std::lock_guard<std::mutex> joined(joining_->mutex);
  if (!joining_->done) {
    joining_->abandoned = true;
  } else if (joining_->comm != nullptr) {
    SYMBIOSIS_NCCL_WARN(ncclCommAbort(joining_->comm));
    joining_->comm = nullptr;
  }
}

bool Communicator::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_ == nullptr) return false;
  ncclResult_t state = ncclSuccess;
  return ncclCommGetAsyncError(as_comm(comm_), &state) != ncclSuccess ||
         (state != ncclSuccess && state != ncclInProgress);
}

bool Communicator::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

#endif  // SYMBIOSIS_WITH_NCCL

}  // namespace symbiosis::nccl
