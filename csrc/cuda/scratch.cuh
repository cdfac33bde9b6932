// Carving a handler's scratch memory (XLA's FFI ScratchAllocator: one block, stream-ordered,
// alive until the handler returns) into the arrays its kernels use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/ffi_util.h"

namespace jaxrec {

// Hands out consecutive arrays of one block of memory (16-byte aligned, the largest
// alignment XLA gives; CUB aligns its own storage), each 256 bytes from the last; with a
// null base it only adds up the bytes.
class Carve {
 public:
  explicit Carve(char* base) : base_(base) {}
  template <typename T>
  T* Take(int64_t count) {
    T* out = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return out;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// Builds a handler's arrays in one block of its scratch memory: Work is a struct built from
// (char* base, args...) that carves its arrays with Carve and keeps their size in `bytes`
// (a null base only counts them). Fails, naming `op`, when XLA has no room.
template <typename Work, typename... Args>
ffi::Error AllocateWork(ffi::ScratchAllocator& scratch, std::string_view op, std::optional<Work>* work,
                        Args... args) {
  const size_t bytes = Work(nullptr, args...).bytes;
  std::optional<void*> buffer = scratch.Allocate(bytes, 16);  // the largest alignment XLA gives
  if (!buffer.has_value()) {
    return ffi::Error::Internal(std::string(op) + ": no " + std::to_string(bytes) +
                                " bytes of scratch memory");
  }
  work->emplace(static_cast<char*>(*buffer), args...);
  return ffi::Error::Success();
}

}  // namespace jaxrec
