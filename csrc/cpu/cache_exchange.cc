// The row exchange of a host-cached table on the CPU (csrc/common/cache_exchange.h).
#include "common/cache_exchange.h"

#include <cstring>
#include <vector>

namespace jaxrec::cpu {

ffi::Error CacheExchangeCpu(ffi::AnyBuffer cache_rows, ffi::AnyBuffer evict_rows, ffi::AnyBuffer load_rows,
                            ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t cache_num_rows,
                            int64_t host_num_rows) {
  std::vector<ExchangeBuffers> pairs;
  if (auto error =
          CheckExchange(cache_rows, evict_rows, load_rows, args, rets, cache_num_rows, host_num_rows, &pairs);
      error.failure()) {
    return error;
  }
  const int32_t* slot = cache_rows.typed_data<int32_t>();
  const int32_t* evict = evict_rows.typed_data<int32_t>();
  const int32_t* load = load_rows.typed_data<int32_t>();
  const int64_t n = static_cast<int64_t>(cache_rows.element_count());
  for (const ExchangeBuffers& p : pairs) {
    // Aliased in place; an unaliased result (XLA copied) starts as the operand.
    if (p.cache != p.cache_in) std::memcpy(p.cache, p.cache_in, p.row_bytes * cache_num_rows);
    if (p.host != p.host_in) std::memcpy(p.host, p.host_in, p.row_bytes * host_num_rows);
    for (int64_t i = 0; i < n; ++i) {
      if (slot[i] < 0 || slot[i] >= cache_num_rows) continue;
      char* row = p.cache + slot[i] * p.row_bytes;
      if (evict[i] >= 0 && evict[i] < host_num_rows)
        std::memcpy(p.host + evict[i] * p.row_bytes, row, p.row_bytes);
      if (load[i] >= 0 && load[i] < host_num_rows)
        std::memcpy(row, p.host + load[i] * p.row_bytes, p.row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxrec::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecCacheExchangeCpu, jaxrec::cpu::CacheExchangeCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // cache_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // evict_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // load_rows
                                  .RemainingArgs()             // (cache, host) buffer pairs
                                  .RemainingRets()             // the pairs, updated
                                  .Attr<int64_t>("cache_num_rows")
                                  .Attr<int64_t>("host_num_rows"));
