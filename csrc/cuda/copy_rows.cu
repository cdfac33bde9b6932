// Row copies between buffers on the GPU (csrc/common/copy_rows.h). A buffer may be pinned
// host memory (JAX's "pinned_host"), which the kernel reads or writes over PCIe directly;
// a warp moves one row, 16 bytes a lane where the rows allow.
//
// Copies in the background (jaxrec_copy_rows_async) run on a stream of jaxrec's own per
// device, after what XLA's stream has issued so far, and return at once: XLA runs a step's
// custom calls one after the other on its stream, so a prefetch that should overlap the
// step's compute has to leave that stream. jaxrec_wait_copies makes XLA's stream wait for
// every background copy issued so far. XLA knows nothing of the second stream, so the
// caller keeps each operand of a background copy alive (an operand of the wait) and lets
// no operation of the step touch the copied rows before the wait
// (jaxrec/ops/host_cache.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>

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

// Launches the copy on ``stream``.
ffi::Error LaunchCopy(cudaStream_t stream, const RowCopy& c, int64_t src_num_rows, int64_t dst_num_rows) {
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

// The checked copy of the operands; XLA's copy of dst made first where it could not alias it.
ffi::Error Prepare(cudaStream_t stream, ffi::AnyBuffer dst_rows, ffi::AnyBuffer src_rows, ffi::AnyBuffer src,
                   ffi::AnyBuffer dst, ffi::Result<ffi::AnyBuffer> out, int64_t src_num_rows,
                   int64_t dst_num_rows, RowCopy* c) {
  if (auto error = CheckCopyRows(dst_rows, src_rows, src, dst, out, src_num_rows, dst_num_rows, c);
      error.failure()) {
    return error;
  }
  if (c->dst != c->dst_in) {  // not aliased: XLA copied
    cudaMemcpyAsync(c->dst, c->dst_in, c->row_bytes * dst_num_rows, cudaMemcpyDefault, stream);
  }
  return ffi::Error::Success();
}

ffi::Error CopyRowsCuda(cudaStream_t stream, ffi::AnyBuffer dst_rows, ffi::AnyBuffer src_rows,
                        ffi::AnyBuffer src, ffi::AnyBuffer dst, ffi::Result<ffi::AnyBuffer> out,
                        int64_t src_num_rows, int64_t dst_num_rows) {
  RowCopy c;
  if (auto error = Prepare(stream, dst_rows, src_rows, src, dst, out, src_num_rows, dst_num_rows, &c);
      error.failure()) {
    return error;
  }
  return LaunchCopy(stream, c, src_num_rows, dst_num_rows);
}

// A device's background stream: ``issued`` is recorded on XLA's stream before each
// background copy, which the background stream waits for; ``done`` after it, which
// jaxrec_wait_copies makes XLA's stream wait for. The background stream runs its copies in
// the order issued, so the last ``done`` covers them all.
struct Background {
  cudaStream_t stream = nullptr;
  cudaEvent_t issued = nullptr;
  cudaEvent_t done = nullptr;
};

std::mutex background_mutex;

// The background of ``stream``'s device, created on first use (and kept for the process).
ffi::Error BackgroundOf(cudaStream_t stream, Background** out) {
  int device = 0;
  if (cudaError_t e = cudaStreamGetDevice(stream, &device); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("copy_rows: no device for XLA's stream: ") +
                                cudaGetErrorString(e));
  }
  static std::map<int, Background> backgrounds;
  Background& b = backgrounds[device];
  if (b.stream == nullptr) {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    cudaError_t e = cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&b.issued, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming);
    cudaSetDevice(current);
    if (e != cudaSuccess) {
      b = Background{};
      return ffi::Error::Internal(std::string("copy_rows: cannot create its background stream: ") +
                                  cudaGetErrorString(e));
    }
  }
  *out = &b;
  return ffi::Error::Success();
}

ffi::Error CopyRowsAsyncCuda(cudaStream_t stream, ffi::AnyBuffer dst_rows, ffi::AnyBuffer src_rows,
                             ffi::AnyBuffer src, ffi::AnyBuffer dst, ffi::Result<ffi::AnyBuffer> out,
                             int64_t src_num_rows, int64_t dst_num_rows) {
  RowCopy c;  // XLA's copy of dst, if any, is on its stream: before the copy below
  if (auto error = Prepare(stream, dst_rows, src_rows, src, dst, out, src_num_rows, dst_num_rows, &c);
      error.failure()) {
    return error;
  }
  std::lock_guard<std::mutex> lock(background_mutex);
  Background* b = nullptr;
  if (auto error = BackgroundOf(stream, &b); error.failure()) return error;
  cudaEventRecord(b->issued, stream);
  cudaStreamWaitEvent(b->stream, b->issued, 0);
  if (auto error = LaunchCopy(b->stream, c, src_num_rows, dst_num_rows); error.failure()) return error;
  cudaEventRecord(b->done, b->stream);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("copy_rows' background copy failed: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// ``x`` (aliased), once XLA's stream has waited for the background copies issued so far.
// The remaining operands are not read: they are what those copies read or write, kept
// alive by XLA until this call.
ffi::Error WaitCopiesCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs,
                          ffi::Result<ffi::AnyBuffer> out) {
  {
    std::lock_guard<std::mutex> lock(background_mutex);
    Background* b = nullptr;
    if (auto error = BackgroundOf(stream, &b); error.failure()) return error;
    cudaStreamWaitEvent(stream, b->done, 0);  // a done never recorded: no wait
  }
  if (out->untyped_data() != x.untyped_data()) {  // not aliased: XLA copied
    cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDefault, stream);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("wait_copies failed: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxrec

// The two copies' binding: in place or in the background, the same operands.
static auto CopyRowsBinding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Arg<xla::ffi::AnyBuffer>()  // dst_rows
      .Arg<xla::ffi::AnyBuffer>()  // src_rows
      .Arg<xla::ffi::AnyBuffer>()  // src
      .Arg<xla::ffi::AnyBuffer>()  // dst
      .Ret<xla::ffi::AnyBuffer>()  // dst, updated
      .Attr<int64_t>("src_num_rows")
      .Attr<int64_t>("dst_num_rows");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCopyRowsCuda, jaxrec::CopyRowsCuda, CopyRowsBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCopyRowsAsyncCuda, jaxrec::CopyRowsAsyncCuda, CopyRowsBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecWaitCopiesCuda, jaxrec::WaitCopiesCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // x
                                  .RemainingArgs()               // kept alive until now
                                  .Ret<xla::ffi::AnyBuffer>());  // x
