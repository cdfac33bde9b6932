// The row exchange of a host-cached table on the GPU (csrc/common/cache_exchange.h). The
// host buffers are pinned host memory (JAX's "pinned_host"), which the kernel reads and
// writes over PCIe directly; a warp moves one row, 16 bytes a lane where the rows allow.
#include <cuda_runtime.h>

#include <vector>

#include "common/cache_exchange.h"

namespace jaxrec {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename Word>
__global__ void ExchangeRows(const int32_t* __restrict__ slot, const int32_t* __restrict__ evict,
                             const int32_t* __restrict__ load, int64_t n, Word* cache, Word* host,
                             int64_t row_words, int64_t cache_num_rows, int64_t host_num_rows) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t i = blockIdx.x * kWarpsPerBlock + threadIdx.y; i < n; i += warps) {
    const int32_t s = slot[i];
    if (s < 0 || s >= cache_num_rows) continue;
    Word* row = cache + s * row_words;
    const int32_t e = evict[i], l = load[i];
    // A lane reads and writes the same words of the row in both loops: no hazard between them.
    if (e >= 0 && e < host_num_rows) {
      for (int64_t w = threadIdx.x; w < row_words; w += 32) host[e * row_words + w] = row[w];
    }
    if (l >= 0 && l < host_num_rows) {
      for (int64_t w = threadIdx.x; w < row_words; w += 32) row[w] = host[l * row_words + w];
    }
  }
}

template <typename Word>
void Launch(cudaStream_t stream, const int32_t* slot, const int32_t* evict, const int32_t* load, int64_t n,
            const ExchangeBuffers& p, int64_t cache_num_rows, int64_t host_num_rows) {
  const int64_t blocks = std::min<int64_t>((n + kWarpsPerBlock - 1) / kWarpsPerBlock, 4096);
  ExchangeRows<Word><<<blocks, dim3(32, kWarpsPerBlock), 0, stream>>>(
      slot, evict, load, n, reinterpret_cast<Word*>(p.cache), reinterpret_cast<Word*>(p.host),
      p.row_bytes / static_cast<int64_t>(sizeof(Word)), cache_num_rows, host_num_rows);
}

bool Aligned(const ExchangeBuffers& p, int64_t bytes) {
  return p.row_bytes % bytes == 0 && reinterpret_cast<uintptr_t>(p.cache) % bytes == 0 &&
         reinterpret_cast<uintptr_t>(p.host) % bytes == 0;
}

ffi::Error CacheExchangeCuda(cudaStream_t stream, ffi::AnyBuffer cache_rows, ffi::AnyBuffer evict_rows,
                             ffi::AnyBuffer load_rows, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             int64_t cache_num_rows, int64_t host_num_rows) {
  std::vector<ExchangeBuffers> pairs;
  if (auto error =
          CheckExchange(cache_rows, evict_rows, load_rows, args, rets, cache_num_rows, host_num_rows, &pairs);
      error.failure()) {
    return error;
  }
  const int64_t n = static_cast<int64_t>(cache_rows.element_count());
  const int32_t* slot = cache_rows.typed_data<int32_t>();
  const int32_t* evict = evict_rows.typed_data<int32_t>();
  const int32_t* load = load_rows.typed_data<int32_t>();
  for (const ExchangeBuffers& p : pairs) {
    // Aliased in place; an unaliased result (XLA copied) starts as the operand.
    if (p.cache != p.cache_in) {
      cudaMemcpyAsync(p.cache, p.cache_in, p.row_bytes * cache_num_rows, cudaMemcpyDefault, stream);
    }
    if (p.host != p.host_in) {
      cudaMemcpyAsync(p.host, p.host_in, p.row_bytes * host_num_rows, cudaMemcpyDefault, stream);
    }
    if (n == 0) continue;
    if (Aligned(p, 16)) {
      Launch<uint4>(stream, slot, evict, load, n, p, cache_num_rows, host_num_rows);
    } else if (Aligned(p, 4)) {
      Launch<uint32_t>(stream, slot, evict, load, n, p, cache_num_rows, host_num_rows);
    } else {
      Launch<uint16_t>(stream, slot, evict, load, n, p, cache_num_rows, host_num_rows);
    }
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return ffi::Error::Internal(std::string("the row exchange's launch failed: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCacheExchangeCuda, jaxrec::CacheExchangeCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // cache_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // evict_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // load_rows
                                  .RemainingArgs()             // (cache, host) buffer pairs
                                  .RemainingRets()             // the pairs, updated
                                  .Attr<int64_t>("cache_num_rows")
                                  .Attr<int64_t>("host_num_rows"));
