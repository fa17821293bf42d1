// [Fuzzing] call_records: the same-host control channel ([Shared-memory control channel] in
// transport/call_ring.h) as a client may write it. An shm channel with a registered payload
// buffer; the input is written into its request ring (its head, then the records' headers from
// the first slot on); the executor's side takes the calls as its scheduler does (poll_channels:
// next_request, [Call check], then the computation in place in the buffer, or the refusal into
// the reply ring) until the ring is empty or found corrupt. Meanwhile the client goes on writing
// its control segment under the executor's feet, as a hostile client's other thread would: before
// each call is taken, one scribble (a word anywhere in the segment: the rings' positions, records
// not yet taken, the flags of [Stream-ordered hand-off], [Captured calls] and [Wake sockets]).
// Input: how far the ring's head claims past what was pushed (8 bytes), the number of scribbles
// (1 byte) and each (a 4-byte offset into the segment, taken modulo its size and aligned to 8, and
// the 8-byte value written there), then the CallHeaders pushed (sizeof(shm::CallHeader) bytes each).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

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
  return op == proto::BACKWARD_INPUT    ? LayerOp::kBackwardInput
         : op == proto::FORWARD_NO_BIAS ? LayerOp::kForwardNoBias
                                        : LayerOp::kForward;
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
  struct Scribble {
    uint32_t offset = 0;
    uint64_t value = 0;
  };
  std::vector<Scribble> scribbles(size > 8 ? data[8] : 0);
  size_t at = 9;
  for (auto& scribble : scribbles) {
    if (at + 12 > size) break;
    std::memcpy(&scribble.offset, data + at, 4);
    std::memcpy(&scribble.value, data + at + 4, 8);
    scribble.offset = scribble.offset % (sizeof(shm::ControlBlock) - 8) / 8 * 8;
    at += 12;
  }
  auto scribble = [&, next = size_t{0}]() mutable {
    if (next < scribbles.size()) {
      std::memcpy(static_cast<char*>(control.data) + scribbles[next].offset, &scribbles[next].value, 8);
      ++next;
    }
  };
  data += std::min(at, size);
  size -= std::min(at, size);
  const size_t records = size / sizeof(shm::CallHeader);
  // The head as the previous input left it: every record it claimed was taken.
  uint64_t pushed = 0;
  std::memcpy(&pushed, static_cast<void*>(&ring), sizeof pushed);
  for (size_t i = 0; i < records && i < shm::CallRing::kCapacity; ++i, ++pushed) {
    shm::CallRecord record;
    std::memcpy(&record.header, data + i * sizeof(shm::CallHeader), sizeof(shm::CallHeader));
    FUZZ_ASSERT(ring.push(record));
  }
  const uint64_t head = pushed + delta;
  std::memcpy(static_cast<void*>(&ring), &head, sizeof head);

  int taken = 0;
  while (true) {
    scribble();
    // What the scheduler asks of every channel between turns ([Wake sockets]).
    channel->executor_sleeps(true);
    (void)channel->has_request();
    channel->executor_sleeps(false);
    auto header = channel->next_request();
    if (!header) break;
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
  // A scribbled segment is no base for the next input's pushes: that one starts a new client.
  if (!scribbles.empty()) client.reset();
}

}  // namespace

void write_seeds(const std::filesystem::path& dir) {
  const BaseModel& model = small_base_model();
  int n = 0;
  // A scribble of the word at `offset` in the control segment.
  auto scribble_at = [](size_t offset, uint64_t value) {
    std::string bytes(12, '\0');
    const auto offset32 = static_cast<uint32_t>(offset);
    std::memcpy(bytes.data(), &offset32, 4);
    std::memcpy(bytes.data() + 4, &value, 8);
    return bytes;
  };
  auto seed = [&](const std::vector<shm::CallHeader>& calls, const std::vector<std::string>& scribbles = {}) {
    std::string bytes(8, '\0');  // the head as pushed
    bytes.push_back(static_cast<char>(scribbles.size()));
    for (const auto& scribble : scribbles) bytes += scribble;
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
  // The client rewrites, under the executor's feet: a record not yet taken (its offsets and tokens),
  // the ring's tail, the flags of the GPU transports and of the wake socket.
  const shm::ControlBlock block;
  auto at = [&](const void* field) {
    return static_cast<size_t>(static_cast<const char*>(field) - reinterpret_cast<const char*>(&block));
  };
  const size_t second_record = at(&block.requests) + 192 + sizeof(shm::CallRecord);  // past head, tail and wait
  seed(all, {scribble_at(second_record + offsetof(shm::CallHeader, in_offset), 1u << 30),
             scribble_at(second_record + offsetof(shm::CallHeader, tokens), 1u << 20),
             scribble_at(at(&block.requests) + 64, 3)});
  seed(all, {scribble_at(at(&block.executor_sleeping), 1), scribble_at(at(&block.inputs_ready), ~0ull),
             scribble_at(at(&block.slots[7]), ~0ull), scribble_at(at(&block.replies), 1000)});
}

}  // namespace symbiosis::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  symbiosis::fuzz::expect_refusal_or_success([&] { symbiosis::fuzz::take(data, size); });
  return 0;
}
