// [Fuzzing] call_records: the same-host control channel ([Shared-memory control channel] in
// transport/call_ring.h) as a client may write it. An shm channel with a registered payload
// buffer; the input is written into its request ring (its head, then the records' headers from
// the first slot on); the executor's side takes the calls as its scheduler does (poll_channels:
// next_request, [Call check], then the computation in place in the buffer, or the refusal into
// the reply ring) until the ring is empty or found corrupt.
// Input: how far the ring's head claims past what was pushed (8 bytes), then the CallHeaders
// pushed (sizeof(shm::CallHeader) bytes each).
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <type_traits>

#include "base_executor/base_model.h"
#include "base_executor/call_check.h"
#include "fuzz/fuzz_support.h"
#include "transport/channel.h"
#include "transport/shared_memory.h"
#include "transport/transport.h"
#include "transport/zmq_wire.h"

namespace symbiosis::fuzz {
namespace {

constexpr size_t kBufferBytes = 4096;

LayerOp to_layer_op(int32_t op) {
  return op == proto::BACKWARD_INPUT ? LayerOp::kBackwardInput
                                     : op == proto::FORWARD_NO_BIAS ? LayerOp::kForwardNoBias : LayerOp::kForward;
}

// The client's view of its control segment, as it maps it.
struct ControlMapping {
  explicit ControlMapping(int descriptor) {
    data = ::mmap(nullptr, sizeof(shm::ControlBlock), PROT_READ | PROT_WRITE, MAP_SHARED, descriptor, 0);
    FUZZ_ASSERT(data != MAP_FAILED);
  }
  ~ControlMapping() { ::munmap(data, sizeof(shm::ControlBlock)); }
  shm::ControlBlock* block() const { return static_cast<shm::ControlBlock*>(data); }
  void* data;
};

// One client's channel, kept from input to input (a new one costs two segments and their mappings,
// most of a run's time) until the executor finds its ring corrupt and drops it.
struct Client {
  Client() : channel(plugin(TransportKind::kShm).make_channel({.client_id = 1})) {
    // The client's payload buffer, registered as its RegisterBuffer would.
    auto buffer = shm::SharedMemory::create("payload", kBufferBytes);
    proto::RegisterBuffer registration;
    registration.set_generation(1);
    registration.set_bytes(kBufferBytes);
    channel->register_buffer(registration, UniqueFd(::dup(buffer.descriptor())));
    control = std::make_unique<ControlMapping>(channel->control_descriptor());
  }
  std::shared_ptr<Channel> channel;
  std::unique_ptr<ControlMapping> control;
};

void take(const uint8_t* data, size_t size) {
  const BaseModel& model = small_base_model();
  static std::unique_ptr<Client> client;
  if (!client || client->channel->broken()) client = std::make_unique<Client>();
  auto& channel = client->channel;
  ControlMapping& control = *client->control;
  // The client reads its replies (else the ring fills and the executor drops it).
  while (control.block()->replies.pop()) {
  }

  // The client pushes the records, then the head may claim more or fewer than it pushed (the
  // head is plain memory to a client: the atomic's bytes, first in the ring).
  static_assert(std::is_standard_layout_v<shm::CallRing>);
  auto& ring = control.block()->requests;
  uint64_t delta = 0;
  std::memcpy(&delta, data, std::min<size_t>(size, 8));
  const size_t records = size > 8 ? (size - 8) / sizeof(shm::CallHeader) : 0;
  // The head as the previous input left it: every record it claimed was taken.
  uint64_t pushed = 0;
  std::memcpy(&pushed, static_cast<void*>(&ring), sizeof pushed);
  for (size_t i = 0; i < records && i < shm::CallRing::kCapacity; ++i, ++pushed) {
    shm::CallRecord record;
    std::memcpy(&record.header, data + 8 + i * sizeof(shm::CallHeader), sizeof(shm::CallHeader));
    FUZZ_ASSERT(ring.push(record));
  }
  const uint64_t head = pushed + delta;
  std::memcpy(static_cast<void*>(&ring), &head, sizeof head);

  int taken = 0;
  while (auto header = channel->next_request()) {
    FUZZ_ASSERT(++taken <= static_cast<int>(shm::CallRing::kCapacity));
    shm::CallHeader h = *header;
    const Status status = check_call(model, kMaxRequestBytes, *channel, h, {h.tokens, h.features});
    if (!status.is_ok()) {
      FUZZ_ASSERT(!status.message().empty());
      channel->refuse(h, status);
      continue;
    }
    const auto& layer = model.layer(h.layer_id);
    const auto op = to_layer_op(h.op);
    const int64_t out_features = op == LayerOp::kBackwardInput ? layer.in_features : layer.out_features;
    const uint64_t element = at::elementSize(layer.dtype);
    // What the check promises: both regions inside the registered buffer, apart.
    const uint64_t in_bytes = h.tokens * h.features * element, out_bytes = h.tokens * out_features * element;
    FUZZ_ASSERT(h.in_segment == 0 && h.out_segment == 0);
    FUZZ_ASSERT(h.in_offset <= kBufferBytes && in_bytes <= kBufferBytes - h.in_offset);
    FUZZ_ASSERT(h.out_offset <= kBufferBytes && out_bytes <= kBufferBytes - h.out_offset);
    auto input = channel->input(h, layer.dtype, {h.tokens, h.features});
    auto destination = channel->destination(h, layer.dtype, {h.tokens, out_features});
    model.compute_into(h.layer_id, op, input, destination);
    channel->reply(h);
  }
  if (channel->broken()) return;  // the front door forgets the client
  // Every call pushed was taken, unless the ring claimed more than it holds.
  FUZZ_ASSERT(!channel->waiting());
}

}  // namespace

void write_seeds(const std::filesystem::path& dir) {
  const BaseModel& model = small_base_model();
  int n = 0;
  auto seed = [&](const std::vector<shm::CallHeader>& calls) {
    std::string bytes(8, '\0');  // the head as pushed
    bytes.append(reinterpret_cast<const char*>(calls.data()), calls.size() * sizeof(shm::CallHeader));
    write_file(dir / ("seed-" + std::to_string(n++)), bytes);
  };
  std::vector<shm::CallHeader> all;
  for (uint32_t id = 0; id < model.layer_count(); ++id) {
    const auto& layer = model.layer(id);
    for (const auto op : {proto::FORWARD, proto::BACKWARD_INPUT, proto::FORWARD_NO_BIAS}) {
      shm::CallHeader h;
      h.request_id = 100 + all.size();
      h.layer_id = id;
      h.op = op;
      h.dtype = wire::to_proto(layer.dtype);
      h.tokens = 2;
      h.features = op == proto::BACKWARD_INPUT ? layer.out_features : layer.in_features;
      h.in_offset = 0;
      h.out_offset = 1024;
      h.buffer_generation = 1;
      seed({h});
      all.push_back(h);
    }
  }
  seed(all);
  seed({});
}

}  // namespace symbiosis::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  symbiosis::fuzz::expect_refusal_or_success([&] { symbiosis::fuzz::take(data, size); });
  return 0;
}
