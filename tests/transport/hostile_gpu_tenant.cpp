// hostile_gpu_tenant: one tenant process that attacks the executor through a GPU transport, by
// speaking the protocol by hand (issue 44, its GPU half). The tests in
// tests/transport/cuda_ipc/cuda_ipc_test.cpp and tests/transport/nccl/nccl_test.cpp run it beside
// honest tenants against an executor in the test process (CUDA IPC cannot open a handle of its own
// process, so the attacker must be another process).
//
// [Hostile GPU tenants]
// Each attack is what a real client sends (transport/cuda_ipc/cuda_ipc_client.cpp,
// transport/nccl/nccl_client.cpp: a Hello with its placement, the proof on the local socket,
// RegisterBuffer or NcclSetup on the proven link, call records with sequences and inputs_ready),
// made wrong on purpose at one point:
//  - free-buffer (cuda-ipc): registers a cudaMalloc'd payload buffer, pushes valid calls, cudaFree's
//    the buffer while they are in flight, pushes more naming it, stays 1 s and exits.
//  - stuck-event (cuda-ipc, headers over ZeroMQ): records its client event on a stream that waits
//    for a host word nobody sets, then sends calls: their inputs are never "written". The executor
//    must hold them without making any stream of its own wait ([No waits on a client] in
//    transport/cuda_ipc/cuda_ipc_channel.cpp). Stays 60 s (or until killed).
//  - destroy-event (cuda-ipc): registers with an event, records it, pushes calls answered by reply
//    (sequence 0, ordered by that event), destroys the event while they are in flight, pushes more.
//  - bogus-handle (cuda-ipc): a RegisterBuffer whose event handle is random bytes, one whose memory
//    handle is random bytes, one whose memory handle names a buffer already freed, one that says its
//    buffer is 32 times larger than it is, and ShareSegments of random bytes and of a segment said to
//    be larger than it is; each must be refused (a size taken on trust would let calls reach past the
//    executor's mapping). Then a valid registration and one call, which must be answered: the
//    executor stays usable to the offender too.
//  - die-in-call (cuda-ipc): pushes calls whose inputs it announces, and exits at once (_exit), its
//    buffer gone while the executor reads it.
//  - stall-ahead (cuda-ipc): makes runs of two captured decode calls (slots 1 and 2), announcing
//    their inputs from its host as its GPU would, until the executor launches such a run ahead of
//    its inputs ([Steps launched ahead] in transport/cuda_ipc/cuda_ipc_channel.cpp); then pushes
//    the run once more and never announces its inputs, so that a stream of the executor's waits on
//    the GPU for flags that never come. Stays 60 s (or until killed): the executor must drop it,
//    saying why, while the honest tenants go on, and let the run go marked void (signal "voided").
//    It offers random bytes as its device words ([Device words] in transport/cuda_ipc/device_words.h):
//    the executor must say they do not map and use the host words.
//  - no-receive (nccl, on cuda:1): sends a call's input, never posts the receive of its result (too
//    large for NCCL to buffer: [Buffered sends]), then sends another call's input and pushes it;
//    stays 15 s. The executor's send of the first result waits on its side stream, the second
//    receive behind it, and the compute stream behind that ([NCCL transfer watchdog] in
//    transport/nccl/nccl_channel.cpp).
//  - no-send (nccl): pushes a call's header but never sends its input; stays 15 s.
//  - abort-mid-transfer (nccl): pushes a call's header, posts the send of an input too large to be
//    buffered, aborts its communicator at once (ncclCommAbort) and exits.
// With --signals DIR the tenant writes DIR/ready once set up, waits for DIR/go before it attacks,
// and writes DIR/attacked once the attack is made, so that a test starts the honest tenants around
// it and knows the attack happened. --hold changes how long it stays after the attack.
//
// Exit status: 0 once the attack was made (bogus-handle: every bogus handle refused and the valid
// call answered); 2 when it could not be made (a valid set-up refused, bad arguments); 3 when the
// executor took a bogus handle; 4 when it left the valid call after them unanswered.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "common/cuda.h"
#include "tests/test_util.h"
#include "transport/call_ring.h"
#include "transport/client_transport.h"
#include "transport/cuda_ipc/cuda_ipc.h"
#include "transport/local_socket.h"
#include "transport/nccl/nccl_comm.h"
#include "transport/shared_memory.h"
#include "transport/zmq_wire.h"

namespace symbiosis {
namespace {

using Clock = std::chrono::steady_clock;

// Exit statuses (the file's header comment).
constexpr int kAttackMade = 0;
constexpr int kCannotAttack = 2;
constexpr int kBogusAccepted = 3;
constexpr int kLeftUnanswered = 4;

// [Buffered sends]: rows of an nccl call large enough that NCCL cannot buffer its transfer whole.
// A send of a small result completes into NCCL's own connection buffers (a few MiB) without the
// peer's receive: a no-receive tenant whose results were 64 rows of 64 floats stalled nothing (seen
// on two H200s). 131072 rows of the layer called (64 in, 128 out in tiny-llama) move 32 MiB in and
// 64 MiB back, within the executor's default --max-request-bytes (256 MiB).
constexpr int64_t kUnbufferedRows = 131072;

// One attack: where the tenant runs, how its headers travel, the rows of its calls, and how long
// it stays once it is made.
struct Attack {
  const char* name;
  const char* transport;
  const char* control;  // "auto": the control segment; "zmq": headers over ZeroMQ
  int device;           // cuda:N of the tenant (the executor is on cuda:0)
  int64_t tokens;
  double hold_seconds;
};
constexpr Attack kAttacks[] = {
    {"free-buffer", "cuda-ipc", "auto", 0, 64, 1},
    {"stuck-event", "cuda-ipc", "zmq", 0, 64, 60},
    {"destroy-event", "cuda-ipc", "auto", 0, 64, 1},
    {"bogus-handle", "cuda-ipc", "auto", 0, 64, 0},
    {"die-in-call", "cuda-ipc", "auto", 0, 64, 0},
    {"stall-ahead", "cuda-ipc", "auto", 0, 8, 60},
    {"no-receive", "nccl", "auto", 1, kUnbufferedRows, 15},
    {"no-send", "nccl", "auto", 1, 64, 15},
    {"abort-mid-transfer", "nccl", "auto", 1, kUnbufferedRows, 0},
};

struct Options {
  std::string executor;           // the executor's endpoint
  std::string attack;             // a name of kAttacks
  std::filesystem::path signals;  // empty: attack at once, tell no one
  double hold_seconds = -1;       // how long to stay after the attack; < 0: the attack's own
  int64_t tokens = -1;            // rows of each call; < 0: the attack's own
};

// The files a test watches ([Hostile GPU tenants]).
class Signals {
 public:
  explicit Signals(std::filesystem::path dir) : dir_(std::move(dir)) {}
  void say(const char* name) const {
    if (!dir_.empty()) std::ofstream(dir_ / name) << ::getpid() << "\n";
  }
  void await_go() const {
    if (dir_.empty()) return;
    const auto deadline = Clock::now() + std::chrono::minutes(5);
    while (!std::filesystem::exists(dir_ / "go")) {
      TORCH_CHECK(Clock::now() < deadline, "no ", (dir_ / "go").string(), " within 5 minutes");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  std::filesystem::path dir_;
};

std::string random_bytes(size_t n) {
  std::random_device device;
  std::string bytes(n, '\0');
  for (auto& b : bytes) b = static_cast<char>(device());
  return bytes;
}

uint64_t align_up(uint64_t bytes) { return (bytes + 255) / 256 * 256; }

// A tenant connected and proven, its Welcome in hand: the control segment and wake socket mapped
// when its headers go through them.
class Connection {
 public:
  Connection(const std::string& endpoint, const Attack& attack) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.set(zmq::sockopt::rcvtimeo, 30000);  // NcclReady comes once both ranks joined
    socket_.connect(endpoint);
    proto::Envelope hello;
    hello.mutable_hello()->set_protocol_version(wire::kProtocolVersion);
    hello.mutable_hello()->set_tenant(std::string("hostile-") + attack.name);
    hello.mutable_hello()->set_transport(attack.transport);
    hello.mutable_hello()->set_control(attack.control);
    *hello.mutable_hello()->mutable_placement() = local_placement("cuda:" + std::to_string(attack.device));
    auto peer = testing::hello_and_prove(socket_, hello);
    TORCH_CHECK(peer.answer.has_welcome(), "the executor did not welcome the tenant: ", peer.answer.DebugString());
    TORCH_CHECK(peer.answer.welcome().transport() == attack.transport, "the executor chose transport ",
                peer.answer.welcome().transport(), ", not ", attack.transport);
    welcome_ = peer.answer.welcome();
    link_ = std::move(peer.link);
    if (welcome_.control_channel()) {
      TORCH_CHECK(peer.descriptors.size() == 2, "Proven brought ", peer.descriptors.size(), " descriptors");
      control_memory_ =
          shm::SharedMemory::map_descriptor(std::move(peer.descriptors[0]), sizeof(shm::ControlBlock), "control");
      control_ = shm::map_block<shm::ControlBlock>(control_memory_);
      wake_ = std::move(peer.descriptors[1]);  // [Wake sockets]
    }
  }

  // The layer every call of the tenant calls: the one with the most outputs (the largest results).
  const proto::LayerInfo& layer() const {
    const auto& layers = welcome_.layers();
    return *std::max_element(layers.begin(), layers.end(),
                             [](const auto& a, const auto& b) { return a.out_features() < b.out_features(); });
  }
  at::ScalarType dtype() const { return wire::from_proto(layer().dtype()); }
  shm::ControlBlock& control() const {
    TORCH_CHECK(control_ != nullptr, "this tenant's headers go over ZeroMQ");
    return *control_;
  }
  int link() const { return link_.get(); }
  zmq::socket_t& socket() { return socket_; }

  // A set-up message on the proven link; the executor's answer (over ZeroMQ).
  proto::Envelope setup(const proto::Envelope& env) { return testing::setup_exchange(socket_, link_.get(), env); }
  proto::Envelope receive() {
    auto frames = wire::recv_all(socket_);
    proto::Envelope env;
    TORCH_CHECK(!frames.empty() && wire::parse(frames[0], &env), "no answer from the executor within 30 s");
    return env;
  }

  // A FORWARD of layer() with `tokens` rows: input at offset 0 of the payload buffer, result after it.
  shm::CallRecord call(uint64_t request_id, int64_t tokens, uint32_t sequence) const {
    shm::CallRecord record;
    auto& h = record.header;
    h.request_id = request_id;
    h.layer_id = layer().id();
    h.op = proto::FORWARD;
    h.dtype = layer().dtype();
    h.latency_class = proto::FINE_TUNING;
    h.tokens = tokens;
    h.features = layer().in_features();
    h.in_offset = 0;
    h.out_offset = align_up(input_bytes(tokens));
    h.buffer_generation = 1;
    h.sequence = sequence;
    return record;
  }
  uint64_t input_bytes(int64_t tokens) const {
    return static_cast<uint64_t>(tokens * layer().in_features()) * at::elementSize(dtype());
  }
  uint64_t call_bytes(int64_t tokens) const {
    return align_up(input_bytes(tokens)) +
           static_cast<uint64_t>(tokens * layer().out_features()) * at::elementSize(dtype());
  }
  void push(const shm::CallRecord& record) {
    TORCH_CHECK(control().requests.push(record), "the request ring is full");
    shm::wake_executor(control(), wake_.get());
  }
  // The same call as a ZeroMQ Request (its payload in the buffer: no frame).
  void send_request(const shm::CallRecord& record) {
    const auto& h = record.header;
    proto::Envelope env;
    auto* r = env.mutable_request();
    r->set_request_id(h.request_id);
    r->set_layer_id(h.layer_id);
    r->set_op(proto::FORWARD);
    r->set_dtype(layer().dtype());
    r->add_shape(h.tokens);
    r->add_shape(h.features);
    r->set_latency_class(proto::FINE_TUNING);
    r->set_in_offset(h.in_offset);
    r->set_out_offset(h.out_offset);
    r->set_buffer_generation(h.buffer_generation);
    socket_.send(wire::serialize(env), zmq::send_flags::none);
  }
  // Replies that came within `wait` (the executor answers a call of sequence 0 by one).
  int replies_within(std::chrono::milliseconds wait, int expected) {
    int replies = 0;
    const auto deadline = Clock::now() + wait;
    while (replies < expected && Clock::now() < deadline) {
      if (control().replies.pop()) {
        replies++;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    return replies;
  }

 private:
  zmq::context_t context_{1};
  zmq::socket_t socket_{context_, zmq::socket_type::dealer};
  proto::Welcome welcome_;
  UniqueFd link_;
  shm::SharedMemory control_memory_;
  shm::ControlBlock* control_ = nullptr;
  UniqueFd wake_;
};

constexpr uint64_t kBufferBytes = uint64_t{4} << 20;

// What a cuda-ipc tenant registers: a cudaMalloc'd buffer and its interprocess event.
struct Registration {
  cuda::DeviceBuffer buffer;
  cuda::InterprocessEvent event;
};

// What an attack leaves in place while the tenant stays after it: its registration, its stuck
// stream's word, its communicator with the transfers it posted.
struct Kept {
  Registration registration;
  std::optional<cuda::PinnedRange> pinned_word;
#ifdef SYMBIOSIS_WITH_NCCL
  std::unique_ptr<nccl::Communicator> communicator;
#endif
  std::vector<at::Tensor> sent;  // inputs whose sends may still be posted
};

proto::Envelope registration(uint64_t generation, const std::string& memory_handle, const std::string& event_handle,
                             uint64_t bytes = kBufferBytes) {
  proto::Envelope env;
  auto* r = env.mutable_register_buffer();
  r->set_generation(generation);
  r->set_bytes(bytes);
  r->set_cuda_ipc_handle(memory_handle);
  r->set_client_event(event_handle);
  return env;
}

// Writes an input of `tokens` rows at the start of `buffer`.
void write_input(const Connection& c, const cuda::DeviceBuffer& buffer, int64_t tokens) {
  TORCH_CHECK(c.call_bytes(tokens) <= buffer.size(), "a call of ", tokens, " rows does not fit the buffer");
  at::from_blob(buffer.data(), {tokens, c.layer().in_features()},
                at::TensorOptions().dtype(c.dtype()).device(at::kCUDA, buffer.device()))
      .normal_();
  c10::cuda::device_synchronize();
}

// Registers a new buffer (generation 1) whose first rows hold an input of `tokens` rows.
Registration register_buffer(Connection& c, int64_t tokens) {
  Registration r{cuda::DeviceBuffer::allocate(0, kBufferBytes), cuda::InterprocessEvent::create(0)};
  write_input(c, r.buffer, tokens);
  const auto answer = c.setup(registration(1, r.buffer.ipc_handle(), r.event.ipc_handle()));
  TORCH_CHECK(answer.has_buffer_registered(), "the executor refused a valid registration: ", answer.DebugString());
  return r;
}

// Announces the inputs of calls up to `last` from the host (as the client's GPU would), then
// pushes calls `first` to `last` (their sequences).
void push_announced(Connection& c, uint32_t first, uint32_t last, int64_t tokens) {
  c.control().inputs_ready.store(last, std::memory_order_release);
  for (uint32_t sequence = first; sequence <= last; ++sequence) c.push(c.call(sequence, tokens, sequence));
}

int free_buffer(Connection& c, const Options& options, const Signals& signals, Kept& kept) {
  kept.registration = register_buffer(c, options.tokens);
  signals.say("ready");
  signals.await_go();
  push_announced(c, 1, 8, options.tokens);
  kept.registration.buffer = cuda::DeviceBuffer();  // cudaFree, while the executor reads and writes it
  push_announced(c, 9, 16, options.tokens);
  std::printf("hostile tenant: freed its payload buffer under 8 calls in flight and pushed 8 more\n");
  return kAttackMade;
}

// The word a stuck stream waits for, a page of its own (it is pinned).
alignas(4096) uint32_t never_set[1024] = {};

int stuck_event(Connection& c, const Options& options, const Signals& signals, Kept& kept) {
  kept.registration = register_buffer(c, options.tokens);
  signals.say("ready");
  signals.await_go();
  // A stream that waits for a word nobody sets, and the client event recorded behind the wait: the
  // event never completes.
  kept.pinned_word.emplace(never_set, sizeof(never_set), /*mapped=*/true);
  const cuda::Stream stream{c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0).stream(), 0};
  cuda::wait_value_on_stream(stream, kept.pinned_word->device_pointer(never_set), 1);
  kept.registration.event.record(stream);
  for (uint32_t i = 1; i <= 8; ++i) c.send_request(c.call(i, options.tokens, 0));
  std::printf("hostile tenant: sent 8 calls over ZeroMQ whose event never completes\n");
  return kAttackMade;
}

int destroy_event(Connection& c, const Options& options, const Signals& signals, Kept& kept) {
  kept.registration = register_buffer(c, options.tokens);
  signals.say("ready");
  signals.await_go();
  const cuda::Stream stream{c10::cuda::getStreamFromPool(false, 0).stream(), 0};
  kept.registration.event.record(stream);  // the input was written before; the event says so
  for (uint32_t i = 1; i <= 4; ++i) c.push(c.call(i, options.tokens, 0));
  kept.registration.event = cuda::InterprocessEvent();  // cudaEventDestroy, while the executor asks it of those calls
  for (uint32_t i = 5; i <= 8; ++i) c.push(c.call(i, options.tokens, 0));
  const int replies = c.replies_within(std::chrono::seconds(10), 8);
  std::printf("hostile tenant: destroyed its event under 4 calls in flight, pushed 4 more; %d of 8 answered\n",
              replies);
  return kAttackMade;
}

int bogus_handle(Connection& c, const Options& options, const Signals& signals, Kept& kept) {
  signals.say("ready");
  signals.await_go();
  const std::string random_memory = random_bytes(sizeof(cudaIpcMemHandle_t));
  const std::string random_event = random_bytes(sizeof(cudaIpcEventHandle_t));
  auto freed = cuda::DeviceBuffer::allocate(0, kBufferBytes);
  const std::string stale_memory = freed.ipc_handle();
  freed = cuda::DeviceBuffer();
  // Whole 2 MiB pages, so that the driver's rounding cannot make the claim come true.
  constexpr uint64_t kSmallBytes = uint64_t{2} << 20, kClaimedBytes = 32 * kSmallBytes;
  auto small = cuda::DeviceBuffer::allocate(0, kSmallBytes);
  auto& real = kept.registration;
  real = {cuda::DeviceBuffer::allocate(0, kBufferBytes), cuda::InterprocessEvent::create(0)};
  // The executor opens the client's event at its first registration that names one it can open:
  // the bogus event goes with a real buffer, the bogus buffers with the real event.
  int accepted = 0;
  auto expect_refused = [&](const proto::Envelope& env, const char* what) {
    const auto answer = c.setup(env);
    if (answer.has_error()) {
      std::printf("hostile tenant: %s refused: %s\n", what, answer.error().message().c_str());
    } else {
      std::printf("hostile tenant: %s ACCEPTED: %s\n", what, answer.ShortDebugString().c_str());
      accepted++;
    }
  };
  expect_refused(registration(1, real.buffer.ipc_handle(), random_event), "an event handle of random bytes");
  expect_refused(registration(1, random_memory, real.event.ipc_handle()), "a memory handle of random bytes");
  expect_refused(registration(1, stale_memory, real.event.ipc_handle()), "the memory handle of a freed buffer");
  // A buffer said to be 32 times its size: calls inside the claim would reach past the mapping.
  expect_refused(registration(1, small.ipc_handle(), real.event.ipc_handle(), kClaimedBytes),
                 "a buffer registered as 32 times its size");
  auto share = [](uint32_t id, uint64_t bytes, const std::string& handle) {
    proto::Envelope env;
    auto* segment = env.mutable_share_segments()->add_add();
    segment->set_id(id);
    segment->set_bytes(bytes);
    segment->set_cuda_ipc_handle(handle);
    return env;
  };
  expect_refused(share(1, kBufferBytes, random_memory), "a shared segment of random bytes");
  expect_refused(share(2, kClaimedBytes, small.ipc_handle()), "a shared segment said to be 32 times its size");
  if (accepted > 0) return kBogusAccepted;  // no call is made: it would use what the executor took
  // Still served: a valid registration, and a call answered by its flag.
  write_input(c, real.buffer, options.tokens);
  const auto answer = c.setup(registration(1, real.buffer.ipc_handle(), real.event.ipc_handle()));
  if (!answer.has_buffer_registered()) {
    std::printf("hostile tenant: a valid registration after the bogus ones was refused: %s\n",
                answer.ShortDebugString().c_str());
    return kLeftUnanswered;
  }
  push_announced(c, 1, 1, options.tokens);
  const bool answered =
      testing::wait_until([&] { return shm::reached(c.control().results_ready.load(std::memory_order_acquire), 1); },
                          std::chrono::seconds(20));
  std::printf("hostile tenant: the call after the bogus handles was %s\n", answered ? "answered" : "NOT answered");
  return answered ? kAttackMade : kLeftUnanswered;
}

[[noreturn]] void die_in_call(Connection& c, const Options& options, const Signals& signals, Kept& kept) {
  kept.registration = register_buffer(c, options.tokens);
  signals.say("ready");
  signals.await_go();
  push_announced(c, 1, 8, options.tokens);
  signals.say("attacked");
  std::fflush(stdout);
  ::_exit(kAttackMade);  // no destructor runs: the buffer goes with the process, under the calls
}

int stall_ahead(Connection& c, const Options& options, const Signals& signals, Kept& kept) {
  kept.registration = register_buffer(c, options.tokens);
  // [Device words] (transport/cuda_ipc/device_words.h): random bytes offered as its words; the
  // executor must say they do not map and hand over through the host words, which this tenant sets.
  const std::string bogus_words = random_bytes(sizeof(c.control().device_words_handle));
  std::memcpy(c.control().device_words_handle, bogus_words.data(), bogus_words.size());
  c.control().device_words_offered.store(1, std::memory_order_release);
  signals.say("ready");
  signals.await_go();
  uint32_t sequence = 0;
  // A captured decode step of two calls; `announce`: their inputs are said to be written.
  auto run = [&](bool announce) {
    for (uint32_t slot = 1; slot <= 2; ++slot) {
      ++sequence;
      auto record = c.call(sequence, options.tokens, sequence);
      record.header.latency_class = proto::INFERENCE_DECODE;
      record.header.slot = slot;
      c.push(record);
      if (announce) c.control().slots[slot].input_ready.store(1, std::memory_order_release);
    }
    return !announce ||
           testing::wait_until(
               [&] { return shm::reached(c.control().results_ready.load(std::memory_order_acquire), sequence); },
               std::chrono::seconds(20));
  };
  bool ahead = false;
  for (int i = 0; i < 200 && !ahead; ++i) {
    if (!run(/*announce=*/true)) {
      std::printf("hostile tenant: a run whose inputs it announced was not answered\n");
      return kLeftUnanswered;
    }
    ahead = request_stats(options.executor, 10000).ahead_calls() > 0;
  }
  if (!ahead) {
    std::printf("hostile tenant: the executor launched none of 200 runs ahead\n");
    return kCannotAttack;
  }
  run(/*announce=*/false);
  std::printf("hostile tenant: pushed a run the executor launches ahead, and never announces its inputs\n");
  // [Voided runs] (transport/cuda_ipc/cuda_ipc_channel.cpp): once the executor lets the run go
  // without its inputs, results_ready comes, and the word saying its results are void must be up.
  std::thread([&c, &signals, sequence] {
    auto& control = c.control();
    if (testing::wait_until(
            [&] { return shm::reached(control.results_ready.load(std::memory_order_acquire), sequence); },
            std::chrono::seconds(60))) {
      signals.say(control.runs_voided.load(std::memory_order_acquire) != 0 ? "voided" : "not-voided");
    }
  }).detach();
  return kAttackMade;
}

#ifdef SYMBIOSIS_WITH_NCCL
// The tenant's end of its 2-rank communicator (rank 0), set up as nccl_client.cpp does.
std::unique_ptr<nccl::Communicator> join_nccl(Connection& c, int device) {
  constexpr std::chrono::milliseconds kJoinTimeout{30000};
  const std::string id = nccl::new_unique_id();
  proto::Envelope setup;
  setup.mutable_nccl_setup()->set_unique_id(id);
  local::send(c.link(), setup);
  auto comm = std::make_unique<nccl::Communicator>(id, /*rank=*/0, device, /*peer=*/1, kJoinTimeout);
  comm->wait_ready(kJoinTimeout);
  const auto answer = c.receive();
  TORCH_CHECK(answer.has_nccl_ready(), "the executor answered NcclSetup with ", answer.ShortDebugString());
  return comm;
}

int nccl_attack(Connection& c, const Attack& attack, const Options& options, const Signals& signals, Kept& kept) {
  constexpr int kExecutorRank = 1;
  const int device = attack.device;
  kept.communicator = join_nccl(c, device);
  auto& comm = *kept.communicator;
  const auto stream = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device)).stream();
  const auto on_gpu = at::TensorOptions().dtype(c.dtype()).device(at::kCUDA, device);
  const int64_t features = c.layer().in_features();
  signals.say("ready");
  signals.await_go();
  const std::string name = attack.name;
  if (name == "no-receive") {
    kept.sent.push_back(at::randn({options.tokens, features}, on_gpu));
    c10::cuda::device_synchronize();
    comm.send(kept.sent.back(), kExecutorRank, stream);
    c.push(c.call(1, options.tokens, 0));
    const int first_reply = c.replies_within(std::chrono::seconds(10), 1);
    // No receive of the first result; the second input follows it.
    kept.sent.push_back(at::randn({options.tokens, features}, on_gpu));
    c10::cuda::device_synchronize();
    comm.send(kept.sent.back(), kExecutorRank, stream);
    c.push(c.call(2, options.tokens, 0));
    const int second_reply = c.replies_within(std::chrono::seconds(2), 1);
    std::printf("hostile tenant: never received call 1's result (call 1 %s), sent call 2 (%s)\n",
                first_reply ? "answered" : "not answered", second_reply ? "answered" : "not answered yet");
  } else if (name == "no-send") {
    c.push(c.call(1, options.tokens, 0));
    const int replies = c.replies_within(std::chrono::seconds(2), 1);
    std::printf("hostile tenant: pushed a call and never sent its input (%s)\n",
                replies ? "answered" : "not answered yet");
  } else {  // abort-mid-transfer
    const int64_t tokens = options.tokens;
    auto input = at::randn({tokens, features}, on_gpu);
    c10::cuda::device_synchronize();
    c.push(c.call(1, tokens, 0));
    comm.send(input, kExecutorRank, stream);
    comm.abort();  // ncclCommAbort, under the send just posted
    signals.say("attacked");
    std::printf("hostile tenant: aborted its communicator under the send of %lld rows\n",
                static_cast<long long>(tokens));
    std::fflush(stdout);
    ::_exit(kAttackMade);
  }
  return kAttackMade;
}
#endif

int run(const Options& options) {
  const Attack* attack = nullptr;
  for (const auto& a : kAttacks) {
    if (options.attack == a.name) attack = &a;
  }
  TORCH_CHECK(attack != nullptr, "unknown attack '", options.attack,
              "' (free-buffer, stuck-event, destroy-event, bogus-handle, die-in-call, no-receive, no-send or "
              "abort-mid-transfer)");
  const int gpus = static_cast<int>(c10::cuda::device_count());
  TORCH_CHECK(gpus > attack->device, "attack ", attack->name, " runs on cuda:", attack->device, "; this machine has ",
              gpus, " GPU(s)");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(attack->device));  // [Stream's device]
  Options chosen = options;
  if (chosen.tokens < 0) chosen.tokens = attack->tokens;
  const Signals signals(options.signals);
  Connection c(options.executor, *attack);
  Kept kept;
  const std::string name = attack->name;
  int status = kCannotAttack;
  if (name == "free-buffer") {
    status = free_buffer(c, chosen, signals, kept);
  } else if (name == "stuck-event") {
    status = stuck_event(c, chosen, signals, kept);
  } else if (name == "destroy-event") {
    status = destroy_event(c, chosen, signals, kept);
  } else if (name == "bogus-handle") {
    status = bogus_handle(c, chosen, signals, kept);
  } else if (name == "die-in-call") {
    die_in_call(c, chosen, signals, kept);
  } else if (name == "stall-ahead") {
    status = stall_ahead(c, chosen, signals, kept);
  } else {
#ifdef SYMBIOSIS_WITH_NCCL
    status = nccl_attack(c, *attack, chosen, signals, kept);
#else
    TORCH_CHECK(false, "attack ", name, " needs NCCL, which this build of symbiosis lacks");
#endif
  }
  signals.say("attacked");
  std::fflush(stdout);
  const double hold = options.hold_seconds >= 0 ? options.hold_seconds : attack->hold_seconds;
  std::this_thread::sleep_for(std::chrono::duration<double>(hold));
  // Lets a stuck stream go (stuck-event), so that nothing of CUDA's waits on it at the end.
  std::atomic_ref<uint32_t>(never_set[0]).store(1, std::memory_order_release);
  std::fflush(stdout);
  ::_exit(status);  // what the attack left posted (NCCL transfers, stream waits) is the driver's to end
}

}  // namespace
}  // namespace symbiosis

int main(int argc, char** argv) {
  symbiosis::Options options;
  CLI::App app{"A tenant that attacks the executor through its GPU transport ([Hostile GPU tenants])"};
  app.add_option("--executor", options.executor, "the executor's endpoint")->required();
  app.add_option("--attack", options.attack,
                 "free-buffer, stuck-event, destroy-event, bogus-handle, die-in-call, no-receive, no-send or "
                 "abort-mid-transfer")
      ->required();
  app.add_option("--signals", options.signals, "a directory for the files ready, go and attacked");
  app.add_option("--hold", options.hold_seconds, "seconds to stay after the attack (default: the attack's own)");
  app.add_option("--tokens", options.tokens, "rows of each call (default: the attack's own)");
  CLI11_PARSE(app, argc, argv);
  try {
    return symbiosis::run(options);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "hostile tenant: cannot attack: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hostile tenant: cannot attack: %s\n", e.what());
  }
  return symbiosis::kCannotAttack;
}
