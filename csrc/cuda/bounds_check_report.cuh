// What the GPU bounds checks find, on the device, and FATAL's error from it: shared by the
// standalone bounds_check_indices handler and the TBE forward, which checks as it reads
// (common/bounds_check.h has the definition both follow).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "common/bounds_check.h"
#include "common/ffi_util.h"

namespace jaxrec {

// The int32[4] report result. `corrections` counts (WARNING only). FATAL: the first bad
// bag and the first bad id as the key (position << 32 | bag), each the all-ones value when
// there is none, taken by atomicMin so that the error names the same bag or id as the
// CPU's sequential loop. bounds_check_indices.cu resets it with memsets before its
// kernels; the TBE forward's FinishCheckKernel writes it whole (tbe_forward.cu).
struct BoundsCheckReport {
  int32_t corrections;
  uint32_t first_bad_bag;
  unsigned long long first_bad_index;
};
static_assert(sizeof(BoundsCheckReport) == 16, "the report is int32[4]");

template <typename T>
T ReadOneFromDevice(const T* device_ptr, cudaStream_t stream) {
  T value{};
  cudaMemcpyAsync(&value, device_ptr, sizeof(T), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  return value;
}

// FATAL: waits for the report and turns a finding into the error the CPU handler gives.
// `op` prefixes the CUDA errors; the messages of bad input are the shared ones.
template <typename I, typename R>
ffi::Error FatalReportError(std::string_view op, const BoundsCheckReport* report, cudaStream_t stream,
                            std::string_view labels, int64_t batch_size, int64_t num_indices,
                            const I* offsets, const I* indices, const R* rows_per_feature) {
  BoundsCheckReport host{};
  cudaError_t err = cudaMemcpyAsync(&host, report, sizeof(host), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) +
                                ": reading the bounds-check report: " + cudaGetErrorString(err));
  }
  if (host.first_bad_bag != std::numeric_limits<uint32_t>::max()) {
    const int64_t k = host.first_bad_bag;
    return ffi::Error::InvalidArgument(
        BadOffsetsMessage(labels, batch_size, k, ReadOneFromDevice(offsets + k, stream),
                          ReadOneFromDevice(offsets + k + 1, stream), num_indices));
  }
  if (host.first_bad_index != std::numeric_limits<unsigned long long>::max()) {
    const int64_t p = static_cast<int64_t>(host.first_bad_index >> 32);
    const int64_t k = static_cast<int64_t>(host.first_bad_index & 0xffffffffull);
    return ffi::Error::InvalidArgument(
        BadIndexMessage(labels, batch_size, k, p, ReadOneFromDevice(indices + p, stream),
                        ReadOneFromDevice(rows_per_feature + k / batch_size, stream)));
  }
  return ffi::Error::Success();
}

}  // namespace jaxrec
