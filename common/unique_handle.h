#pragma once
// [Owned handles] Every handle a library gives out (a CUDA event, graph, IPC mapping or pinned
// range; a shared-memory mapping or name) is owned by one UniqueHandle: move-only, copying
// deleted, and released exactly once, by its Release, when its owner goes or is assigned another
// (ggml's unique_ptr deleters in ggml-cpp.h, c10d's NCCLComm). The classes that wrap handles hold
// UniqueHandles and so need no hand-written moves or destructors of their own.
//  - Handle: a cheap value; Handle{} means "none" (nullptr, an empty name).
//  - Release: callable as release(handle); it may carry what releasing needs (a size, a device).
//    It must not throw: a destructor calls it (use the _WARN checks of common/cuda_check.h).
#include <utility>

namespace symbiosis {

template <typename Handle, typename Release>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(Handle handle, Release release = Release()) : handle_(handle), release_(std::move(release)) {}
  ~UniqueHandle() { reset(); }
  UniqueHandle(UniqueHandle&& other) noexcept
      : handle_(std::exchange(other.handle_, Handle{})), release_(std::move(other.release_)) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, Handle{});
      release_ = std::move(other.release_);
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;

  const Handle& get() const { return handle_; }
  const Release& releaser() const { return release_; }
  explicit operator bool() const { return handle_ != Handle{}; }
  // Releases the handle now (if any); the owner holds none after.
  void reset() {
    if (handle_ != Handle{}) release_(std::exchange(handle_, Handle{}));
  }

 private:
  Handle handle_{};
  Release release_{};
};

}  // namespace symbiosis
