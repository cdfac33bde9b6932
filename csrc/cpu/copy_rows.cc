// Row copies between buffers on the CPU (csrc/common/copy_rows.h). The CPU has no second
// stream: a background copy (jaxrec_copy_rows_async) is this handler, done when it
// returns, and jaxrec_wait_copies has nothing to wait for.
#include "common/copy_rows.h"

#include <cstring>

namespace jaxrec::cpu {

ffi::Error CopyRowsCpu(ffi::AnyBuffer dst_rows, ffi::AnyBuffer src_rows, ffi::AnyBuffer src,
                       ffi::AnyBuffer dst, ffi::Result<ffi::AnyBuffer> out, int64_t src_num_rows,
                       int64_t dst_num_rows) {
  RowCopy c;
  if (auto error = CheckCopyRows(dst_rows, src_rows, src, dst, out, src_num_rows, dst_num_rows, &c);
      error.failure()) {
    return error;
  }
  if (c.dst != c.dst_in) std::memcpy(c.dst, c.dst_in, c.row_bytes * dst_num_rows);  // not aliased: XLA copied
  for (int64_t i = 0; i < c.n; ++i) {
    const int32_t d = c.dst_rows[i], s = c.src_rows[i];
    if (d >= 0 && d < dst_num_rows && s >= 0 && s < src_num_rows) {
      std::memcpy(c.dst + d * c.row_bytes, c.src + s * c.row_bytes, c.row_bytes);
    }
  }
  return ffi::Error::Success();
}

// ``x``: the background copies are done already.
ffi::Error WaitCopiesCpu(ffi::AnyBuffer x, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != x.untyped_data())
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace jaxrec::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCopyRowsCpu, jaxrec::cpu::CopyRowsCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // dst_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // src_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // src
                                  .Arg<xla::ffi::AnyBuffer>()  // dst
                                  .Ret<xla::ffi::AnyBuffer>()  // dst, updated
                                  .Attr<int64_t>("src_num_rows")
                                  .Attr<int64_t>("dst_num_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecWaitCopiesCpu, jaxrec::cpu::WaitCopiesCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x
                                  .RemainingArgs()               // kept alive until now
                                  .Ret<xla::ffi::AnyBuffer>());  // x
