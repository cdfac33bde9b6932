// Row copies between two flat row-major buffers (jaxrec.ops.host_cache.copy_rows), shared
// checks of the CPU and CUDA handlers: dst[dst_rows[i]] = src[src_rows[i]] for every i
// whose two rows lie in their buffers (others are skipped: no entry touches memory outside
// its buffers). The result is dst, aliased to the operand (updated in place). The entries
// must name distinct dst rows, so that they run in any order.
//
// A host-cached table's row exchange is two such copies per buffer (weights, optimizer
// state): evicted rows cache -> host, then missed rows host -> cache. One result per call
// on purpose: XLA's host offloading follows a host buffer through a custom call that
// returns it alone, not through one that returns a tuple.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_util.h"

namespace jaxrec {

struct RowCopy {
  int64_t n;          // entries
  int64_t row_bytes;  // width * itemsize
  const int32_t* dst_rows;
  const int32_t* src_rows;
  const char* src;
  const char* dst_in;
  char* dst;
};

inline ffi::Error CheckCopyRows(ffi::AnyBuffer dst_rows, ffi::AnyBuffer src_rows, ffi::AnyBuffer src,
                                ffi::AnyBuffer dst, ffi::Result<ffi::AnyBuffer> out, int64_t src_num_rows,
                                int64_t dst_num_rows, RowCopy* copy) {
  const int64_t n = static_cast<int64_t>(dst_rows.element_count());
  for (auto [b, name] : {std::pair{dst_rows, "dst_rows"}, {src_rows, "src_rows"}}) {
    if (b.element_type() != ffi::DataType::S32 || static_cast<int64_t>(b.element_count()) != n) {
      return ffi::Error::InvalidArgument(std::string(name) + " must be int32[" + std::to_string(n) +
                                         "], got " + DtypeName(b.element_type()) + "[" +
                                         std::to_string(b.element_count()) + "]");
    }
  }
  const int64_t src_size = static_cast<int64_t>(src.element_count());
  const int64_t dst_size = static_cast<int64_t>(dst.element_count());
  const int64_t width = dst_num_rows > 0 ? dst_size / dst_num_rows : 0;
  if (src_num_rows < 1 || dst_num_rows < 1 || src.element_type() != dst.element_type() || width < 1 ||
      dst_size != width * dst_num_rows || src_size != width * src_num_rows) {
    return ffi::Error::InvalidArgument(
        "copy_rows: src " + DtypeName(src.element_type()) + "[" + std::to_string(src_size) + "] and dst " +
        DtypeName(dst.element_type()) + "[" + std::to_string(dst_size) +
        "] must hold src_num_rows=" + std::to_string(src_num_rows) +
        " and dst_num_rows=" + std::to_string(dst_num_rows) + " rows of one width and dtype");
  }
  *copy = {n,
           width * static_cast<int64_t>(ffi::ByteWidth(dst.element_type())),
           dst_rows.typed_data<int32_t>(),
           src_rows.typed_data<int32_t>(),
           static_cast<const char*>(src.untyped_data()),
           static_cast<const char*>(dst.untyped_data()),
           static_cast<char*>(out->untyped_data())};
  return ffi::Error::Success();
}

}  // namespace jaxrec
