#pragma once
// The benchmarks' transport names: the client's own ("auto", "tcp", "shm", "cuda-ipc", "nccl"),
// and "cuda-ipc-buffer": cuda-ipc with each call copied through the payload buffer instead of
// handing the executor the client's own tensors ([Direct operands]).
#include <string>

#include <symbiosis/client.h>

namespace symbiosis::bench {

inline void set_transport(ClientOptions& options, const std::string& name) {
  options.direct_operands = name != "cuda-ipc-buffer";
  options.transport = options.direct_operands ? name : "cuda-ipc";
}

}  // namespace symbiosis::bench
