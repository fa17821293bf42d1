#pragma once
// symbiosis-executor --parts N / --gpus LIST: starts a sharded executor's parts ([Parts] in
// parts.h) on this host, one process each, and stays until they end.
#include <string>

#include "base_executor/executor.h"

namespace symbiosis {

// Runs this program again once per part, with the arguments it was given less --parts, --gpus,
// --listen, --device, --rank, --world-size and --rendezvous, and with each part's: its rank, the
// world size, one rendezvous (`options.parts.rendezvous`, or a free loopback port), its device
// (cpu, or cuda:G of the G listed in `gpus`) and its endpoint (`options.listen` with the port
// raised by the rank; "*" stays "*"). Once every part is ready, their "ready ENDPOINT" lines
// are printed in rank order (one that ends before it is ready stops the others). A stop signal is passed on to every part; when one part ends, the others stop on their
// own ([Lost part]). Returns 0 when every part exited 0, else 1; throws (TORCH_CHECK) when it cannot
// start them, after stopping those it started.
int launch_parts(int argc, char** argv, const ExecutorOptions& options, int parts, const std::string& gpus);

}  // namespace symbiosis
