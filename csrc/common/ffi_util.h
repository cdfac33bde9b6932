// Small helpers shared by the CPU and CUDA FFI handlers: element type names for
// messages, and the dtype dispatches that turn an operand's runtime dtype into a
// template argument.
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

// The numpy name of an XLA element type, for error messages.
inline std::string DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::BF16:
      return "bfloat16";
    default:
      return "XLA element type " + std::to_string(static_cast<int>(dtype));
  }
}

inline bool IsIndexType(ffi::DataType dtype) {
  return dtype == ffi::DataType::S32 || dtype == ffi::DataType::S64;
}

inline bool IsFloatType(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16;
}

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
      return ffi::Error::InvalidArgument(std::string(argument) + " must be int32 or int64, got " +
                                         DtypeName(dtype));
  }
}

// Calls `fn(T{})` for the float element type `dtype`: T = float for F32, and the
// platform's 16-bit storage types `F16` and `BF16` (cpu::Half and cpu::BFloat16 on
// the CPU, __half and __nv_bfloat16 on the GPU); anything else is an InvalidArgument
// error that names `argument`. The handlers validate the dtypes first (tbe_validate.h).
template <typename F16, typename BF16, typename Fn>
ffi::Error DispatchFloatType(ffi::DataType dtype, std::string_view argument, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::F16:
      return fn(F16{});
    case ffi::DataType::BF16:
      return fn(BF16{});
    default:
      return ffi::Error::InvalidArgument(std::string(argument) +
                                         " must be float32, float16 or bfloat16, got " + DtypeName(dtype));
  }
}

}  // namespace jaxrec
