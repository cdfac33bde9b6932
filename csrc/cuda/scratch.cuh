// Carving a handler's scratch memory (XLA's FFI ScratchAllocator: one block, stream-ordered,
// alive until the handler returns) into the arrays its kernels use.
#pragma once

#include <cstddef>
#include <cstdint>

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

}  // namespace jaxrec
