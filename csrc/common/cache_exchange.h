// The row exchange of a host-cached table (jaxrec.ops.host_cache): shared checks of the CPU
// and CUDA handlers.
//
// Operands: cache_rows, evict_rows, load_rows (int32[N]), then K pairs (cache buffer, host
// buffer) of flat row-major buffers, the weights and each optimizer-state buffer. Entry i
// with cache_rows[i] >= 0 first writes cache row cache_rows[i] of every cache buffer to row
// evict_rows[i] of its host buffer (if evict_rows[i] >= 0), then loads row load_rows[i] of
// the host buffer into it (if load_rows[i] >= 0). The results are the K pairs, aliased to
// the operands (updated in place). Rows out of a buffer are skipped: no entry touches
// memory outside its buffers. The entries name distinct cache rows and distinct host rows
// (the index gives a slot to one id and an id to one slot), so they run in any order.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/ffi_util.h"

namespace jaxrec {

struct ExchangeBuffers {
  int64_t row_bytes;  // of this pair's buffers: width * itemsize
  const char* cache_in;
  char* cache;
  const char* host_in;
  char* host;
};

// Checks the operands and fills `pairs` (out of `args` from operand 3 on and `rets`).
inline ffi::Error CheckExchange(ffi::AnyBuffer cache_rows, ffi::AnyBuffer evict_rows,
                                ffi::AnyBuffer load_rows, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                int64_t cache_num_rows, int64_t host_num_rows,
                                std::vector<ExchangeBuffers>* pairs) {
  const int64_t n = static_cast<int64_t>(cache_rows.element_count());
  for (auto [b, name] :
       {std::pair{cache_rows, "cache_rows"}, {evict_rows, "evict_rows"}, {load_rows, "load_rows"}}) {
    if (b.element_type() != ffi::DataType::S32 || static_cast<int64_t>(b.element_count()) != n) {
      return ffi::Error::InvalidArgument(std::string(name) + " must be int32[" + std::to_string(n) +
                                         "], got " + DtypeName(b.element_type()) + "[" +
                                         std::to_string(b.element_count()) + "]");
    }
  }
  if (args.size() % 2 || args.size() != rets.size() || cache_num_rows < 1 || host_num_rows < 1) {
    return ffi::Error::InvalidArgument(
        "the row exchange takes (cache, host) buffer pairs and returns them, got " +
        std::to_string(args.size()) + " buffers and " + std::to_string(rets.size()) + " results for " +
        std::to_string(cache_num_rows) + " cache rows and " + std::to_string(host_num_rows) + " host rows");
  }
  for (size_t k = 0; 2 * k < rets.size(); ++k) {
    auto cache = args.get<ffi::AnyBuffer>(2 * k), host = args.get<ffi::AnyBuffer>(2 * k + 1);
    auto cache_out = rets.get<ffi::AnyBuffer>(2 * k), host_out = rets.get<ffi::AnyBuffer>(2 * k + 1);
    if (cache.has_error() || host.has_error() || cache_out.has_error() || host_out.has_error()) {
      return ffi::Error::InvalidArgument("buffer pair " + std::to_string(k) + " could not be decoded");
    }
    const int64_t itemsize = ffi::ByteWidth(cache->element_type());
    const int64_t cache_size = static_cast<int64_t>(cache->element_count());
    const int64_t host_size = static_cast<int64_t>(host->element_count());
    const int64_t width = cache_size / cache_num_rows;
    if (host->element_type() != cache->element_type() || width < 1 || cache_size != width * cache_num_rows ||
        host_size != width * host_num_rows) {
      return ffi::Error::InvalidArgument(
          "buffer pair " + std::to_string(k) + ": the cache buffer " + DtypeName(cache->element_type()) +
          "[" + std::to_string(cache->element_count()) + "] and host buffer " +
          DtypeName(host->element_type()) + "[" + std::to_string(host->element_count()) + "] must hold " +
          std::to_string(cache_num_rows) + " and " + std::to_string(host_num_rows) +
          " rows of one width and dtype");
    }
    pairs->push_back({width * itemsize, static_cast<const char*>(cache->untyped_data()),
                      static_cast<char*>((*cache_out)->untyped_data()),
                      static_cast<const char*>(host->untyped_data()),
                      static_cast<char*>((*host_out)->untyped_data())});
  }
  return ffi::Error::Success();
}

}  // namespace jaxrec
