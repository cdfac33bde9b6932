// CUDA handler of bounds_check_indices (see common/bounds_check.h for the definition).
//
// 1. One block scans the offsets (running max of the clamped offsets) into the
//    corrected offsets. A single block needs no scratch memory (XLA's FFI scratch
//    allocator is not available to GPU handlers here); T*B+1 offsets are few.
// 2. One warp per bag checks the bag against its original end and its ids,
//    fixes bad ids in place (indices are aliased) and counts corrections.
// FATAL mode keeps the offsets, records the first bad bag / id with atomicMin
// (so the reported error is the same as on the CPU), then synchronises the
// stream to turn a finding into an error: FATAL is for debugging, not speed.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>

#include "common/bounds_check.h"
#include "common/ffi_util.h"
#include "cuda/bounds_check_report.cuh"

namespace jaxrec {
namespace {

constexpr int kWarpSize = 32;
constexpr int kBagsPerBlock = 8;

using Report = BoundsCheckReport;

// corrections 0; FATAL: the first bad bag and id all ones (none found yet).
inline cudaError_t ResetReport(BoundsCheckReport* report, BoundsCheckMode mode, cudaStream_t stream) {
  if (mode != BoundsCheckMode::kFatal) return cudaMemsetAsync(report, 0, sizeof(BoundsCheckReport), stream);
  const cudaError_t err = cudaMemsetAsync(report, 0xff, sizeof(BoundsCheckReport), stream);
  return err != cudaSuccess ? err : cudaMemsetAsync(&report->corrections, 0, sizeof(int32_t), stream);
}

constexpr int kScanThreads = 1024;
constexpr int kScanItems = 8;  // consecutive offsets per thread and tile

// offsets[i] = max(clamp(offsets_in[0..i], 0, num_indices)), tile by tile with a carry.
template <typename T>
__global__ void __launch_bounds__(kScanThreads)
    ScanClampedMax(const T* __restrict__ offsets_in, T* __restrict__ offsets, int64_t n, T num_indices) {
  __shared__ T warp_max[kScanThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  T carry = 0;  // every clamped offset is >= 0, so 0 is the identity of max
  for (int64_t tile = 0; tile < n; tile += int64_t{kScanThreads} * kScanItems) {
    const int64_t first = tile + int64_t{threadIdx.x} * kScanItems;
    T items[kScanItems];
    T running = 0;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      const T value = first + j < n ? ClampOffset(offsets_in[first + j], num_indices) : T{0};
      running = value > running ? value : running;
      items[j] = running;
    }
    T inclusive = running;  // inclusive max-scan over the lanes of the warp
#pragma unroll
    for (int s = 1; s < kWarpSize; s *= 2) {
      const T other = __shfl_up_sync(0xffffffff, inclusive, s);
      if (lane >= s && other > inclusive) inclusive = other;
    }
    if (lane == kWarpSize - 1) warp_max[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      T total = warp_max[lane];
#pragma unroll
      for (int s = 1; s < kWarpSize; s *= 2) {
        const T other = __shfl_up_sync(0xffffffff, total, s);
        if (lane >= s && other > total) total = other;
      }
      warp_max[lane] = total;
    }
    __syncthreads();
    T prefix = __shfl_up_sync(0xffffffff, inclusive, 1);
    if (lane == 0) prefix = 0;
    if (warp > 0 && warp_max[warp - 1] > prefix) prefix = warp_max[warp - 1];
    if (carry > prefix) prefix = carry;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      if (first + j < n) offsets[first + j] = items[j] > prefix ? items[j] : prefix;
    }
    if (warp_max[kScanThreads / kWarpSize - 1] > carry) carry = warp_max[kScanThreads / kWarpSize - 1];
    __syncthreads();  // warp_max is rewritten by the next tile
  }
}

template <typename T>
__global__ void CheckBags(const T* __restrict__ rows_per_table, T* __restrict__ indices, T num_indices,
                          const T* __restrict__ offsets_in, T* offsets, int64_t num_bags, int64_t batch_size,
                          BoundsCheckMode mode, Report* report) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kBagsPerBlock + threadIdx.y;
  const int lane = threadIdx.x;
  if (k >= num_bags) return;

  T start = k == 0 ? offsets_in[0] : offsets[k];
  T end = offsets_in[k + 1];
  if (IsBadBag(start, end, num_indices)) {
    if (mode == BoundsCheckMode::kFatal) {
      if (lane == 0) atomicMin(&report->first_bad_bag, static_cast<uint32_t>(k));
      return;
    }
    if (mode == BoundsCheckMode::kWarning && lane == 0) atomicAdd(&report->corrections, 1);
  }
  if (mode != BoundsCheckMode::kFatal) {
    start = ClampOffset(start, num_indices);
    end = offsets[k + 1];  // corrected by the scan
  }

  const T num_rows = rows_per_table[k / batch_size];
  int32_t corrections = 0;
  for (T p = start + lane; p < end; p += kWarpSize) {
    const T id = indices[p];
    if (!IsBadIndex(id, num_rows)) continue;
    if (mode == BoundsCheckMode::kFatal) {
      atomicMin(&report->first_bad_index,
                (static_cast<unsigned long long>(p) << 32) | static_cast<unsigned long long>(k));
    } else {
      indices[p] = 0;
      ++corrections;
    }
  }
  if (mode == BoundsCheckMode::kWarning) {
    for (int s = kWarpSize / 2; s > 0; s /= 2) corrections += __shfl_down_sync(0xffffffff, corrections, s);
    if (lane == 0 && corrections > 0) atomicAdd(&report->corrections, corrections);
  }
}

ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("bounds_check_indices: ") + what + ": " + cudaGetErrorString(err));
}

#define JAXREC_CUDA_RETURN_IF_ERROR(expr, what)            \
  do {                                                     \
    cudaError_t err_ = (expr);                             \
    if (err_ != cudaSuccess) return CudaError(err_, what); \
  } while (0)

template <typename T>
ffi::Error BoundsCheck(cudaStream_t stream, const T* rows_per_table, int64_t num_features, T* indices,
                       int64_t num_indices, const T* offsets_in, T* offsets, int64_t num_bags,
                       BoundsCheckMode mode, std::string_view labels, Report* report) {
  const int64_t batch_size = num_features > 0 ? num_bags / num_features : 1;
  const T n = static_cast<T>(num_indices);

  JAXREC_CUDA_RETURN_IF_ERROR(ResetReport(report, mode, stream), "memset");
  if (mode == BoundsCheckMode::kFatal) {
    JAXREC_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(offsets, offsets_in, (num_bags + 1) * sizeof(T), cudaMemcpyDeviceToDevice, stream),
        "copy offsets");
  } else {
    ScanClampedMax<T><<<1, kScanThreads, 0, stream>>>(offsets_in, offsets, num_bags + 1, n);
    JAXREC_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "scan launch");
  }
  if (num_bags == 0) return ffi::Error::Success();

  const int64_t blocks = (num_bags + kBagsPerBlock - 1) / kBagsPerBlock;
  CheckBags<T><<<static_cast<unsigned>(blocks), dim3(kWarpSize, kBagsPerBlock), 0, stream>>>(
      rows_per_table, indices, n, offsets_in, offsets, num_bags, batch_size, mode, report);
  JAXREC_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launch");
  if (mode != BoundsCheckMode::kFatal) return ffi::Error::Success();

  return FatalReportError("bounds_check_indices", report, stream, labels, batch_size, num_indices, offsets_in,
                          indices, rows_per_table);
}

ffi::Error BoundsCheckIndicesCuda(cudaStream_t stream, ffi::AnyBuffer rows_per_table,
                                  ffi::AnyBuffer indices_in, ffi::AnyBuffer offsets_in,
                                  ffi::Result<ffi::AnyBuffer> indices, ffi::Result<ffi::AnyBuffer> offsets,
                                  ffi::Result<ffi::Buffer<ffi::S32>> report, int32_t mode,
                                  std::string_view labels) {
  if (ffi::Error error = ValidateBoundsCheck(mode, rows_per_table, indices_in, offsets_in); error.failure()) {
    return error;
  }
  const int64_t num_indices = indices_in.element_count();
  const int64_t num_bags = static_cast<int64_t>(offsets_in.element_count()) - 1;
  const int64_t num_features = rows_per_table.element_count();
  return DispatchIndexType(indices_in.element_type(), "indices", [&](auto zero) {
    using T = decltype(zero);
    if (indices->untyped_data() != indices_in.untyped_data()) {
      JAXREC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(indices->untyped_data(), indices_in.untyped_data(),
                                                  num_indices * sizeof(T), cudaMemcpyDeviceToDevice, stream),
                                  "copy indices");
    }
    return BoundsCheck<T>(stream, rows_per_table.typed_data<T>(), num_features, indices->typed_data<T>(),
                          num_indices, offsets_in.typed_data<T>(), offsets->typed_data<T>(), num_bags,
                          static_cast<BoundsCheckMode>(mode), labels,
                          reinterpret_cast<Report*>(report->typed_data()));
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecBoundsCheckIndicesCuda, jaxrec::BoundsCheckIndicesCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // rows_per_table
                                  .Arg<xla::ffi::AnyBuffer>()              // indices
                                  .Arg<xla::ffi::AnyBuffer>()              // offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // indices (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // offsets
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // report
                                  .Attr<int32_t>("mode")
                                  .Attr<std::string_view>("labels"));
