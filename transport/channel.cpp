#include "transport/channel.h"

#include <c10/util/Exception.h>
#include <google/protobuf/descriptor.h>
#include <spdlog/spdlog.h>

#include <new>
#include <vector>

#include "transport/zmq_wire.h"

namespace symbiosis {

Channel::Channel(TransportKind kind, uint64_t client_id, bool with_control_segment)
    : kind_(kind), client_id_(client_id) {
  if (!with_control_segment) return;
  control_ = shm::SharedMemory::create("control", sizeof(shm::ControlBlock));
  block_ = new (control_.data()) shm::ControlBlock();
  block_->magic = shm::ControlBlock::kMagic;
  wake_.emplace();
}

UniqueFd Channel::take_wake_writer() { return wake_ ? wake_->take_writer() : UniqueFd(); }

bool Channel::has_request() const {
  return block_ != nullptr && zmq_context_ == nullptr && !broken() && block_->requests.has_after(next_read_);
}

void Channel::executor_sleeps(bool sleeping) {
  if (block_ != nullptr && zmq_context_ == nullptr) block_->executor_sleeping.store(sleeping ? 1 : 0);
}

Channel::~Channel() = default;

void Channel::receive_frames(shm::CallHeader&, std::vector<zmq::message_t>) {
  TORCH_CHECK(false, "internal: a ", kind_name(), " payload does not come in ZeroMQ frames");
}

proto::Envelope Channel::set_up(const proto::Envelope& message) {
  // The body's own message name ("ShareSegments"), as the client's code spells it.
  const auto* body = message.GetDescriptor()->FindFieldByNumber(message.body_case());
  TORCH_CHECK(false, body != nullptr ? body->message_type()->name() : std::string("an empty envelope"), " from a ",
              kind_name(), " client: transport ", kind_name(), " takes no such set-up message");
}

void Channel::receive_into(const shm::CallHeader&, const at::Tensor&) {
  TORCH_CHECK(false, "internal: a ", kind_name(), " input is read where it lies, not received");
}

void Channel::deliver(const shm::CallHeader&, const at::Tensor&) {
  TORCH_CHECK(false, "internal: a ", kind_name(), " result has a destination and is not delivered");
}

const std::deque<shm::CallHeader>& Channel::pending() {
  if (broken() || block_ == nullptr || zmq_context_ != nullptr) return waiting_;
  // Held calls are bounded like the ring: a client runs at most twice its capacity ahead of its GPU.
  while (waiting_.size() < shm::CallRing::kCapacity) {
    bool corrupt = false;
    auto record = block_->requests.pop_untrusted(&next_read_, &corrupt);
    if (corrupt) {
      drop("its request ring is corrupt");
      break;
    }
    if (!record) break;
    waiting_.push_back(record->header);
  }
  return waiting_;
}

void Channel::hand_out(size_t n) {
  waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<std::ptrdiff_t>(n));
}

void Channel::drop(const std::string& why) {
  spdlog::warn("client {}: {}; dropping the client", client_id_, why);
  broken_ = true;
}

std::optional<shm::CallHeader> Channel::next_request() {
  if (broken() || block_ == nullptr || zmq_context_ != nullptr) return std::nullopt;
  pending();
  if (broken() || waiting_.empty() || !input_ready(waiting_.front())) return std::nullopt;
  auto h = waiting_.front();
  waiting_.pop_front();
  taken(h);
  return h;
}

void Channel::refuse(const shm::CallHeader& h, const Status& status) {
  push_reply(h, status);
  after_refusal(h);
}

void Channel::control_over_zmq(zmq::context_t& context, std::string replies_endpoint, std::string identity) {
  zmq_context_ = &context;
  replies_endpoint_ = std::move(replies_endpoint);
  identity_ = std::move(identity);
}

void Channel::push_reply(const shm::CallHeader& h, const Status& status) {
  if (zmq_context_ != nullptr) {
    if (!replies_) {
      replies_ = std::make_unique<zmq::socket_t>(*zmq_context_, zmq::socket_type::push);
      replies_->set(zmq::sockopt::linger, 0);
      replies_->connect(replies_endpoint_);
    }
    proto::Envelope env;
    std::vector<zmq::message_t> payload;
    if (status.is_ok()) {
      env.mutable_reply()->set_request_id(h.request_id);
      ok_reply(h, *env.mutable_reply(), payload);
    } else {
      env = wire::error_envelope(h.request_id, status, /*as_reply=*/true);
    }
    wire::send_to(*replies_, identity_, env, payload);
    return;
  }
  shm::CallRecord record;
  record.header = h;
  record.error_code = wire::to_proto(status.code());
  if (!status.message().empty()) record.set_message(status.message());
  // The client has one call in flight, so its reply ring has room; if not, it stopped reading.
  if (!block_->replies.push(record)) {
    spdlog::warn("client {}: its reply ring is full; dropping the client", client_id_);
    broken_ = true;
    return;
  }
  block_->replies.wait().notify();
}

namespace {

Status invalid(std::string message) { return {StatusCode::kInvalidArgument, std::move(message)}; }

// Whether a call's input and output regions lie in what the client registered and shared.
Status check_regions(const shm::CallHeader& h, uint64_t in_bytes, uint64_t out_bytes,
                     RegisteredBufferChannel::Region in, RegisteredBufferChannel::Region out, uint64_t generation) {
  if (h.in_segment == 0 || h.out_segment == 0) {
    if (generation == 0) return invalid("no payload buffer is registered (send RegisterBuffer first)");
    if (h.buffer_generation != generation) {
      return invalid("names payload buffer generation " + std::to_string(h.buffer_generation) + ", but generation " +
                     std::to_string(generation) + " is registered");
    }
  }
  auto missing = [](uint32_t segment) {
    return "names segment " + std::to_string(segment) + ", which the client has not shared (send ShareSegments first)";
  };
  if (in.base == nullptr) return invalid("input " + missing(h.in_segment));
  if (out.base == nullptr) return invalid("output " + missing(h.out_segment));
  auto inside = [](uint64_t offset, uint64_t bytes, uint64_t size) { return offset <= size && bytes <= size - offset; };
  auto outside = [](const char* what, uint64_t offset, uint64_t bytes, uint64_t segment, uint64_t size) {
    return invalid(std::string(what) + " [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                   ") lies outside the " + std::to_string(size) + "-byte " +
                   (segment == 0 ? std::string("payload buffer") : "shared segment " + std::to_string(segment)));
  };
  if (!inside(h.in_offset, in_bytes, in.size)) return outside("input", h.in_offset, in_bytes, h.in_segment, in.size);
  if (!inside(h.out_offset, out_bytes, out.size)) {
    return outside("output", h.out_offset, out_bytes, h.out_segment, out.size);
  }
  if (h.in_offset % 16 != 0 || h.out_offset % 16 != 0) return invalid("payload offsets must be multiples of 16 bytes");
  const char* input = in.base + h.in_offset;
  const char* output = out.base + h.out_offset;
  if (input < output + out_bytes && output < input + in_bytes) return invalid("input and output regions overlap");
  return Status::ok();
}

}  // namespace

proto::BufferRegistered RegisteredBufferChannel::register_buffer(const proto::RegisterBuffer& r, UniqueFd segment) {
  TORCH_CHECK(r.generation() == generation_ + 1, "RegisterBuffer generation ", r.generation(), ", expected ",
              generation_ + 1);
  proto::BufferRegistered answer;
  map(r, std::move(segment), &answer);
  generation_ = r.generation();
  answer.set_generation(generation_);
  return answer;
}

Status RegisteredBufferChannel::check_payload(const shm::CallHeader& h, uint64_t in_bytes, uint64_t out_bytes) const {
  return check_regions(h, in_bytes, out_bytes, region(h.in_segment), region(h.out_segment), generation_);
}

at::Tensor RegisteredBufferChannel::input(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) {
  return view(region(h.in_segment), h.in_offset, dtype, shape);
}

at::Tensor RegisteredBufferChannel::destination(const shm::CallHeader& h, at::ScalarType dtype, at::IntArrayRef shape) {
  return view(region(h.out_segment), h.out_offset, dtype, shape);
}

RegisteredBufferChannel::Region RegisteredBufferChannel::region(uint32_t segment) const {
  if (segment != 0) return shared_segment(segment);
  return {static_cast<const char*>(base()), base() == nullptr ? 0 : size()};
}

at::Tensor RegisteredBufferChannel::view(Region region, uint64_t offset, at::ScalarType dtype,
                                         at::IntArrayRef shape) const {
  return at::from_blob(const_cast<char*>(region.base) + offset, shape, view_options().dtype(dtype));
}

}  // namespace symbiosis
