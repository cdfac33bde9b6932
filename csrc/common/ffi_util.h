// Small helpers shared by the CPU and CUDA FFI handlers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define JAXREC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAXREC_HOST_DEVICE inline
#endif

namespace jaxrec {

namespace ffi = xla::ffi;

// Calls `fn(IndexType{})` for the integer element type `dtype` (int32 or int64),
// the index types of every jaxrec op; anything else is an InvalidArgument error
// that names `argument`. The Python wrappers validate first; this is the last line.
template <typename Fn>
ffi::Error DispatchIndexType(ffi::DataType dtype, std::string_view argument, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::S32:
      return fn(int32_t{});
    case ffi::DataType::S64:
      return fn(int64_t{});
    default:
      return ffi::Error::InvalidArgument(std::string(argument) +
                                         " must be int32 or int64, got XLA element type " +
                                         std::to_string(static_cast<int>(dtype)));
  }
}

}  // namespace jaxrec
