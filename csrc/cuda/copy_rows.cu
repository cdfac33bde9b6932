// Row copies between buffers on the GPU (csrc/common/copy_rows.h). A buffer may be pinned
// host memory (JAX's "pinned_host"), which the kernel reads or writes over PCIe directly;
// a warp moves one row, 16 bytes a lane where the rows allow.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/copy_rows.h"

namespace jaxrec {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename Word>
__global__ void CopyRowsKernel(const int32_t* __restrict__ dst_rows, const int32_t* __restrict__ src_rows,
                               int64_t n, const Word* src, Word* dst, int64_t row_words, int64_t src_num_rows,
                               int64_t dst_num_rows) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t i = blockIdx.x * kWarpsPerBlock + threadIdx.y; i < n; i += warps) {
    const int64_t d = dst_rows[i], s = src_rows[i];
    if (d < 0 || d >= dst_num_rows || s < 0 || s >= src_num_rows) continue;
    for (int64_t w = threadIdx.x; w < row_words; w += 32) dst[d * row_words + w] = src[s * row_words + w];
  }
}

template <typename Word>
void Launch(cudaStream_t stream, const RowCopy& c, int64_t src_num_rows, int64_t dst_num_rows) {
  const int64_t blocks = std::min<int64_t>((c.n + kWarpsPerBlock - 1) / kWarpsPerBlock, 8192);
  CopyRowsKernel<Word><<<blocks, dim3(32, kWarpsPerBlock), 0, stream>>>(
      c.dst_rows, c.src_rows, c.n, reinterpret_cast<const Word*>(c.src), reinterpret_cast<Word*>(c.dst),
      c.row_bytes / static_cast<int64_t>(sizeof(Word)), src_num_rows, dst_num_rows);
}

bool Aligned(const RowCopy& c, int64_t bytes) {
  return c.row_bytes % bytes == 0 && reinterpret_cast<uintptr_t>(c.src) % bytes == 0 &&
         reinterpret_cast<uintptr_t>(c.dst) % bytes == 0;
}

ffi::Error CopyRowsCuda(cudaStream_t stream, ffi::AnyBuffer dst_rows, ffi::AnyBuffer src_rows,
                        ffi::AnyBuffer src, ffi::AnyBuffer dst, ffi::Result<ffi::AnyBuffer> out,
                        int64_t src_num_rows, int64_t dst_num_rows) {
  RowCopy c;
  if (auto error = CheckCopyRows(dst_rows, src_rows, src, dst, out, src_num_rows, dst_num_rows, &c);
      error.failure()) {
    return error;
  }
  if (c.dst != c.dst_in) {  // not aliased: XLA copied
    cudaMemcpyAsync(c.dst, c.dst_in, c.row_bytes * dst_num_rows, cudaMemcpyDefault, stream);
  }
  if (c.n > 0) {
    if (Aligned(c, 16)) {
      Launch<uint4>(stream, c, src_num_rows, dst_num_rows);
    } else if (Aligned(c, 4)) {
      Launch<uint32_t>(stream, c, src_num_rows, dst_num_rows);
    } else {
      Launch<uint16_t>(stream, c, src_num_rows, dst_num_rows);
    }
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("copy_rows' launch failed: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCopyRowsCuda, jaxrec::CopyRowsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // dst_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // src_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // src
                                  .Arg<xla::ffi::AnyBuffer>()  // dst
                                  .Ret<xla::ffi::AnyBuffer>()  // dst, updated
                                  .Attr<int64_t>("src_num_rows")
                                  .Attr<int64_t>("dst_num_rows"));
