#include "common/status.h"

#include <c10/util/Exception.h>

namespace symbiosis {

Status status_of_exception(const std::exception& e, StatusCode code) {
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&e)) {
    return {code, torch_error->what_without_backtrace()};
  }
  return {code, e.what()};
}

}  // namespace symbiosis
