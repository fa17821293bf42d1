#pragma once
// [Call check] Every call the executor takes, whichever transport brought it, passes this one
// check before it is queued: the layer exists, the op and dtype are the layer's, the shape is
// [tokens >= 1, features] and within --max-request-bytes, the call's ordering fields fit its
// transport, and its payload is where its channel can read and write it. A refusal names the
// request, the layer and what was expected.
#include <cstdint>
#include <vector>

#include "base_executor/base_model.h"
#include "common/status.h"
#include "transport/call_ring.h"
#include "transport/channel.h"

namespace symbiosis {

// Checks call `h` of `channel`'s client, whose input has `shape`, and fills h.tokens and
// h.features from it. A refused call's h is left as its refusal must be answered (a sequence or a
// slot the call may not have is cleared, so the refusal goes back as a reply).
Status check_call(const BaseModel& model, uint64_t max_request_bytes, const Channel& channel, shm::CallHeader& h,
                  const std::vector<int64_t>& shape);

}  // namespace symbiosis
