// CUDA handler of the TBE forward (see common/tbe.h for the layout).
//
// One launch for all features. The warp schedule gives each feature groups of
// 2^shift lanes per bag (4 columns per lane per chunk), so a dim-16 table uses 4
// lanes per bag and 8 bags per warp, a dim-128 table a whole warp per bag. Each
// lane keeps kUnroll rows in flight (16-byte loads for f32) and sums in float32
// in index order: no atomics, the same result every run.
//
// Bad input reads nothing outside the feature's table nor the indices: each bag's
// range is clamped into [0, N] (ClampBag) and an id outside [0, rows) loads row 0.
//
// The bounds check is done here, as the ids are read, for every mode
// (common/bounds_check.h): NONE pools the rare bag with a bad id again over its valid
// ids only (PoolValidIds4); WARNING and IGNORE keep row 0 for it (FBGEMM's correction)
// and WARNING counts it; FATAL flags it and the handler raises. The corrected offsets
// are max-scans of the clamped ones; each bag clamps its own, which is the same whenever
// the clamped offsets do not decrease. When they do (bad input only), the bag flags it.
// Bags note what they found in g_tally (atomics, bad input only); a one-block kernel
// after the lookup (FinishCheckKernel) writes the report, and only when a bag flagged
// unsorted offsets does more: every bag again with the exact correction
// (RedoUnsortedBags). So on good input WARNING and IGNORE cost a compare per id and one
// small launch: no memset, no atomics. On Hopper and later that launch is a programmatic
// dependent one: the lookup's blocks allow it to start once they have all started, and it
// waits for the lookup to finish (griddepcontrol), so its launch overlaps the lookup's
// last wave instead of following it. (The last block to finish used to write the report,
// found by a ticket; its atomic and fence per block cost 7-17% of the forward on an H200
// at B=4096, against 0-3% without them: docs/bounds_check.md.) FATAL, which waits for its report anyway,
// then runs FindFirstBad to name the first bad bag or id.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "common/bounds_check.h"
#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cuda/bounds_check_report.cuh"
#include "cuda/tbe_util.cuh"

namespace jaxrec {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 4;

// The layout's arrays (table_offsets, dims, rows, output_offsets in device memory), and the batch.
struct ForwardArgs : TbeLayout {
  WarpSchedule schedule;
  int64_t batch_size;
  int64_t total_dim;  // pooled: output row width; sequence: dim
  int32_t num_warps;
  int64_t num_indices;              // N
  const float* per_sample_weights;  // nullptr when unweighted
  bool mean;
  BoundsCheckMode mode;
  BoundsCheckReport* report;  // nullptr under NONE
};

// What the blocks of the running checked forward found, per device: each call starts
// with it zero and its FinishCheckKernel sets it back to zero. This assumes one checked
// forward at a time per device, as XLA runs them (one compute stream, and these handlers
// are not captured in command buffers).
constexpr uint32_t kUnsorted = 1;    // WARNING, IGNORE: clamped offsets decrease somewhere
constexpr uint32_t kFatalFound = 2;  // FATAL: a bad bag or id
struct CheckTally {
  int32_t corrections;  // WARNING
  uint32_t flags;
};
__device__ CheckTally g_tally;

// What a bag found (rare), noted by one lane of its group.
__device__ __forceinline__ void NoteBad(BoundsCheckMode mode, int32_t bad, bool unsorted) {
  if (mode == BoundsCheckMode::kFatal) {
    if (bad > 0) atomicOr(&g_tally.flags, kFatalFound);
    return;
  }
  if (unsorted) atomicOr(&g_tally.flags, kUnsorted);
  if (mode == BoundsCheckMode::kWarning && bad > 0) atomicAdd(&g_tally.corrections, bad);
}

// The bag's weighted sum of columns [c, c + 4) for 4-aligned rows, a bad id loading row
// 0 so that every load is a row of the table; *bad counts the bag's bad ids. One compare
// and a select per id, no extra pass over the ids; what the checks cost against the
// unchecked kernel is measured by benchmarks/bounds_check_gpu.py (docs/bounds_check.md).
template <typename W, typename I>
__device__ __forceinline__ float4 PoolColumns4(const W* __restrict__ table, const I* __restrict__ indices,
                                               const float* __restrict__ psw, I start, I end, I last_row,
                                               int64_t dim, int64_t c, int32_t* bad) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  int32_t any = 0;
  I p = start;
  for (; p + kUnroll <= end; p += kUnroll) {
    float4 v[kUnroll];
    float w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const I id = indices[p + u];
      const bool ok = IdInTable(id, last_row);
      any += !ok;
      v[u] = Load4(table + static_cast<int64_t>(ok ? id : I{0}) * dim + c);
      w[u] = psw ? psw[p + u] : 1.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) Fma4(acc, w[u], v[u]);
  }
  for (; p < end; ++p) {
    const I id = indices[p];
    const bool ok = IdInTable(id, last_row);
    any += !ok;
    Fma4(acc, psw ? psw[p] : 1.f, Load4(table + static_cast<int64_t>(ok ? id : I{0}) * dim + c));
  }
  *bad = any;
  return acc;
}

// The same sum over the ids inside [0, rows) only: the rare bag with a bad id under NONE,
// which drops it. One id at a time, so that it adds no registers to the common path.
template <typename W, typename I>
__device__ __forceinline__ float4 PoolValidIds4(const W* __restrict__ table, const I* __restrict__ indices,
                                                const float* __restrict__ psw, I start, I end, int64_t rows,
                                                int64_t dim, int64_t c) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (I p = start; p < end; ++p) {
    const I id = indices[p];
    if (RowInRange(id, rows))
      Fma4(acc, psw ? psw[p] : 1.f, Load4(table + static_cast<int64_t>(id) * dim + c));
  }
  return acc;
}

// The bag of this lane's group: its output columns, and what it found. kSequence:
// PoolingMode::kNone, one output row per index position. kChecked: any mode but NONE (a
// kernel of its own, so that NONE's keeps its registers and its speed).
template <typename W, typename O, typename I, bool kSequence, bool kChecked>
__device__ __forceinline__ void LookupBag(const W* __restrict__ weights, const I* __restrict__ indices,
                                          const I* __restrict__ offsets, O* __restrict__ out,
                                          const ForwardArgs& args) {
  const int32_t warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (warp >= args.num_warps) return;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t f = args.schedule.FeatureOfWarp(warp);
  const int shift = __ldg(args.schedule.shift + f);
  const int group_lane = lane & ((1 << shift) - 1);
  const int64_t b = int64_t{warp - __ldg(args.schedule.start + f)} * (kWarpSize >> shift) + (lane >> shift);
  if (b >= args.batch_size) return;

  const int64_t bag = f * args.batch_size + b;
  // Positions fit I (N < 2^31 is validated for int32 ids).
  const I n = static_cast<I>(args.num_indices);
  const I raw_start = offsets[bag], raw_end = offsets[bag + 1];
  I start, end;
  ClampBag<I>(raw_start, raw_end, n, &start, &end);
  constexpr bool checked = kChecked;
  // WARNING's bad bag: by its clamped start (bag 0: its own), which is the corrected one
  // unless `unsorted`; FATAL's: by its given offsets, and none of its ids are read.
  int32_t bad = 0;
  bool unsorted = false;
  if (checked && IsBadBag(raw_start, raw_end, n)) {
    unsorted = ClampOffset(raw_end, n) < start;
    bad = args.mode == BoundsCheckMode::kFatal || IsBadBag(bag == 0 ? raw_start : start, raw_end, n);
    if (args.mode == BoundsCheckMode::kFatal) {
      if (group_lane == 0) NoteBad(args.mode, bad, unsorted);
      return;
    }
  }
  const int64_t dim = __ldg(args.dims + f);
  const int64_t rows = __ldg(args.rows + f);
  // A table without rows has no row 0 for a bad id: its bags read nothing, all its ids are bad.
  const I first = start;
  const I last = rows > 0 ? end : start;
  if (rows == 0) bad += static_cast<int32_t>(end - start);
  const I last_row = LastRow<I>(rows);
  const W* table = weights + __ldg(args.table_offsets + f);
  const bool vector_rows = dim % 4 == 0 && __ldg(args.table_offsets + f) % 4 == 0;
  const float* psw = args.per_sample_weights;
  const int64_t chunk = int64_t{4} << shift;

  if constexpr (kSequence) {
    for (int64_t p = first; p < last; ++p) {
      const I id = indices[p];
      const bool ok = IdInTable(id, last_row);
      bad += !ok;
      if (!ok && !checked) continue;  // the output was zeroed: a zero row
      const W* row = table + static_cast<int64_t>(ok ? id : I{0}) * dim;
      O* out_row = out + static_cast<int64_t>(p) * dim;
      for (int64_t c = 4 * group_lane; c < dim; c += chunk) {
        const int count = ColumnsLeft(dim, c);
        if (vector_rows) {
          Store4(out_row + c, Load4(row + c));
        } else {
          StorePartial4(out_row + c, LoadPartial4(row + c, count), count);
        }
      }
    }
  } else {
    O* out_row = out + b * args.total_dim + __ldg(args.output_offsets + f);
    const bool vector_out = args.total_dim % 4 == 0 && __ldg(args.output_offsets + f) % 4 == 0;
    const float scale = args.mean && end > start ? 1.f / static_cast<float>(end - start) : 1.f;
    for (int64_t c = 4 * group_lane; c < dim; c += chunk) {
      const int count = ColumnsLeft(dim, c);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      int32_t bad_ids = 0;
      if (vector_rows) {
        acc = PoolColumns4(table, indices, psw, first, last, last_row, dim, c, &bad_ids);
        if (bad_ids > 0 && !checked) acc = PoolValidIds4(table, indices, psw, first, last, rows, dim, c);
      } else {
        for (I p = first; p < last; ++p) {
          const I id = indices[p];
          const bool ok = IdInTable(id, last_row);
          bad_ids += !ok;
          if (ok || checked) {
            Fma4(acc, psw ? psw[p] : 1.f,
                 LoadPartial4(table + static_cast<int64_t>(ok ? id : I{0}) * dim + c, count));
          }
        }
      }
      if (c == 0) bad += bad_ids;  // each lane saw all the bag's ids; the first lane counts them
      acc = Scale4(acc, scale);
      if (vector_out && count == 4) {
        Store4(out_row + c, acc);
      } else {
        StorePartial4(out_row + c, acc, count);
      }
    }
  }
  if (checked && group_lane == 0 && (bad > 0 || unsorted)) NoteBad(args.mode, bad, unsorted);
}

constexpr int kThreads = kWarpsPerBlock * kWarpSize;

// Inclusive max-scan over the block of one value per thread; every thread must call it.
template <typename I>
__device__ I BlockInclusiveMax(I value, I* warp_max) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int s = 1; s < kWarpSize; s *= 2) {
    const I other = __shfl_up_sync(0xffffffff, value, s);
    if (lane >= s && other > value) value = other;
  }
  if (lane == kWarpSize - 1) warp_max[warp] = value;
  __syncthreads();
  if (warp == 0) {
    I total = lane < kWarpsPerBlock ? warp_max[lane] : I{0};
#pragma unroll
    for (int s = 1; s < kWarpSize; s *= 2) {
      const I other = __shfl_up_sync(0xffffffff, total, s);
      if (lane >= s && other > total) total = other;
    }
    if (lane < kWarpsPerBlock) warp_max[lane] = total;
  }
  __syncthreads();
  if (warp > 0 && warp_max[warp - 1] > value) value = warp_max[warp - 1];
  __syncthreads();  // warp_max is written again by the next call
  return value;
}

// One bag over its exactly corrected range [start, end), by one warp: bad ids are row 0
// (none for a table without rows), in index order as in TbeForwardKernel, so a bag
// computes to the same bits either way. WARNING's id count goes to lane 0's *count.
template <typename W, typename O, typename I, bool kSequence>
__device__ void RedoBag(const W* __restrict__ weights, const I* __restrict__ indices, O* __restrict__ out,
                        const ForwardArgs& args, int64_t bag, I start, I end, int lane, int32_t* count) {
  const int64_t f = bag / args.batch_size, b = bag % args.batch_size;
  const int64_t dim = args.dims[f], rows = args.rows[f];
  const W* table = weights + args.table_offsets[f];
  const float* psw = args.per_sample_weights;
  if (lane == 0 && args.mode == BoundsCheckMode::kWarning) {
    for (I p = start; p < end; ++p) *count += !RowInRange(indices[p], rows);
  }
  if constexpr (kSequence) {
    for (I p = start; p < end; ++p) {
      const I id = indices[p];
      const bool ok = RowInRange(id, rows);
      if (!ok && rows == 0) continue;
      const W* row = table + static_cast<int64_t>(ok ? id : I{0}) * dim;
      for (int64_t c = 4 * lane; c < dim; c += 4 * kWarpSize) {
        const int columns = ColumnsLeft(dim, c);
        StorePartial4(out + static_cast<int64_t>(p) * dim + c, LoadPartial4(row + c, columns), columns);
      }
    }
  } else {
    O* out_row = out + b * args.total_dim + args.output_offsets[f];
    const float scale = args.mean && end > start ? 1.f / static_cast<float>(end - start) : 1.f;
    for (int64_t c = 4 * lane; c < dim; c += 4 * kWarpSize) {
      const int columns = ColumnsLeft(dim, c);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (I p = start; p < end; ++p) {
        const I id = indices[p];
        const bool ok = RowInRange(id, rows);
        if (!ok && rows == 0) continue;
        Fma4(acc, psw ? psw[p] : 1.f,
             LoadPartial4(table + static_cast<int64_t>(ok ? id : I{0}) * dim + c, columns));
      }
      StorePartial4(out_row + c, Scale4(acc, scale), columns);
    }
  }
}

// WARNING and IGNORE with unsorted offsets, by FinishCheckKernel's block: the whole lookup
// again with the corrected offsets max-scanned tile by tile, and WARNING's count
// recounted exactly. Bad input only, so it is written for clarity, not speed.
template <typename W, typename O, typename I, bool kSequence>
__device__ void RedoUnsortedBags(const W* __restrict__ weights, const I* __restrict__ indices,
                                 const I* __restrict__ offsets, O* __restrict__ out,
                                 const ForwardArgs& args) {
  __shared__ I corrected[kThreads + 1];
  __shared__ I warp_max[kWarpsPerBlock];
  __shared__ int32_t total;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t num_bags = args.batch_size * args.num_features;
  const I n = static_cast<I>(args.num_indices);
  if constexpr (kSequence) {
    for (int64_t i = threadIdx.x; i < args.num_indices * args.total_dim; i += kThreads)
      out[i] = FromFloat<O>(0.f);
  }
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  int32_t count = 0;
  I carry = 0;  // corrected[tile - 1]; every clamped offset is >= 0
  for (int64_t tile = 0; tile < num_bags; tile += kThreads) {
    const int64_t k = tile + threadIdx.x;
    I value = BlockInclusiveMax(k <= num_bags ? ClampOffset(offsets[k], n) : I{0}, warp_max);
    if (carry > value) value = carry;
    corrected[threadIdx.x] = value;
    if (threadIdx.x == kThreads - 1) {
      const I next = k + 1 <= num_bags ? ClampOffset(offsets[k + 1], n) : I{0};
      corrected[kThreads] = next > value ? next : value;
    }
    __syncthreads();
    carry = corrected[kThreads - 1];
    for (int j = warp; j < kThreads && tile + j < num_bags; j += kWarpsPerBlock) {
      const int64_t bag = tile + j;
      if (lane == 0 && args.mode == BoundsCheckMode::kWarning &&
          IsBadBag(bag == 0 ? offsets[0] : corrected[j], offsets[bag + 1], n)) {
        ++count;
      }
      RedoBag<W, O, I, kSequence>(weights, indices, out, args, bag, corrected[j], corrected[j + 1], lane,
                                  &count);
    }
    __syncthreads();  // corrected is written again by the next tile
  }
  if (count > 0) atomicAdd(&total, count);
  __syncthreads();
  if (threadIdx.x == 0) args.report->corrections = total;
}

// One block, after the checked lookup: the report from the tally (and the rare extra
// work), then the tally back to zero for the next call.
template <typename W, typename O, typename I, bool kSequence>
__global__ void __launch_bounds__(kThreads)
    FinishCheckKernel(const W* __restrict__ weights, const I* __restrict__ indices,
                      const I* __restrict__ offsets, O* __restrict__ out, ForwardArgs args) {
  WaitForPrimaryGrid();  // the lookup's tally and output, complete and visible
  const volatile CheckTally* tally = &g_tally;
  const uint32_t flags = tally->flags;
  const int32_t corrections = tally->corrections;
  BoundsCheckReport* report = args.report;
  if (threadIdx.x == 0) {  // FATAL: corrections = 1 tells FindFirstBad there is something to find
    report->corrections = args.mode == BoundsCheckMode::kWarning ? corrections
                          : args.mode == BoundsCheckMode::kFatal
                              ? static_cast<int32_t>((flags & kFatalFound) != 0)
                              : 0;
    report->first_bad_bag = std::numeric_limits<uint32_t>::max();
    report->first_bad_index = std::numeric_limits<unsigned long long>::max();
  }
  __syncthreads();
  if (args.mode != BoundsCheckMode::kFatal && (flags & kUnsorted)) {
    RedoUnsortedBags<W, O, I, kSequence>(weights, indices, offsets, out, args);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    g_tally.corrections = 0;
    g_tally.flags = 0;
  }
}

template <typename W, typename O, typename I, bool kSequence, bool kChecked>
__global__ void __launch_bounds__(kThreads)
    TbeForwardKernel(const W* __restrict__ weights, const I* __restrict__ indices,
                     const I* __restrict__ offsets, O* __restrict__ out, ForwardArgs args) {
  if constexpr (kChecked) AllowDependentLaunch();
  LookupBag<W, O, I, kSequence, kChecked>(weights, indices, offsets, out, args);
}

// FATAL, after FinishCheckKernel (the handler then waits for the report): nothing unless
// a bag flagged a bad offset or id; then the first bad bag and the first bad id (by
// position), as bounds_check_indices finds them, for the handler's error.
template <typename I>
__global__ void __launch_bounds__(kThreads)
    FindFirstBad(const I* __restrict__ indices, const I* __restrict__ offsets, ForwardArgs args) {
  BoundsCheckReport* report = args.report;
  if (report->corrections == 0) return;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t num_bags = args.batch_size * args.num_features;
  const I n = static_cast<I>(args.num_indices);
  for (int64_t bag = warp; bag < num_bags; bag += kWarpsPerBlock) {
    const I start = offsets[bag], end = offsets[bag + 1];
    if (IsBadBag(start, end, n)) {
      if (lane == 0) atomicMin(&report->first_bad_bag, static_cast<uint32_t>(bag));
      continue;
    }
    const int64_t rows = args.rows[bag / args.batch_size];
    for (I p = start + lane; p < end; p += kWarpSize) {
      if (!RowInRange(indices[p], rows)) {
        atomicMin(&report->first_bad_index,
                  (static_cast<unsigned long long>(p) << 32) | static_cast<unsigned long long>(bag));
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) report->corrections = 0;
}

template <typename W, typename O, typename I>
ffi::Error Launch(cudaStream_t stream, const ffi::AnyBuffer& weights, const ffi::AnyBuffer& indices,
                  const ffi::AnyBuffer& offsets, ffi::AnyBuffer* out, const ForwardArgs& args, bool sequence,
                  std::string_view labels) {
  const unsigned blocks = (args.num_warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (sequence) {
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  }
  const W* w = reinterpret_cast<const W*>(weights.untyped_data());
  O* o = reinterpret_cast<O*>(out->untyped_data());
  const bool checked = args.mode != BoundsCheckMode::kNone;
  if (blocks > 0) {
    auto kernel =
        sequence
            ? (checked ? TbeForwardKernel<W, O, I, true, true> : TbeForwardKernel<W, O, I, true, false>)
            : (checked ? TbeForwardKernel<W, O, I, false, true> : TbeForwardKernel<W, O, I, false, false>);
    kernel<<<blocks, kThreads, 0, stream>>>(w, indices.typed_data<I>(), offsets.typed_data<I>(), o, args);
  }
  if (checked) {  // the report, always written
    auto finish = sequence ? FinishCheckKernel<W, O, I, true> : FinishCheckKernel<W, O, I, false>;
    cudaError_t err = LaunchDependent(finish, stream, kThreads, w, indices.typed_data<I>(),
                                      offsets.typed_data<I>(), o, args);
    if (err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jaxrec_tbe_forward report launch: ") +
                                  cudaGetErrorString(err));
    }
  }
  if (args.mode == BoundsCheckMode::kFatal) {
    FindFirstBad<I><<<1, kThreads, 0, stream>>>(indices.typed_data<I>(), offsets.typed_data<I>(), args);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxrec_tbe_forward launch: ") + cudaGetErrorString(err));
  }
  if (args.mode != BoundsCheckMode::kFatal) return ffi::Error::Success();
  return FatalReportError("jaxrec_tbe_forward", args.report, stream, labels, args.batch_size,
                          args.num_indices, offsets.typed_data<I>(), indices.typed_data<I>(), args.rows);
}

constexpr std::string_view kOp = "jaxrec_tbe_forward";

ffi::Error TbeForwardCuda(cudaStream_t stream, ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                          ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                          ffi::Buffer<ffi::S32> schedule, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::S32>> report, int32_t pooling, int64_t num_warps,
                          int32_t bounds_check_mode, std::string_view labels) {
  TbeBatch batch;
  if (ffi::Error error =
          ValidateForward(kOp, weights, indices, offsets, per_sample_weights, layout, *out, pooling, &batch);
      error.failure()) {
    return error;
  }
  const int64_t num_features = batch.layout.num_features;
  if (static_cast<int64_t>(schedule.element_count()) != 2 * num_features + 1) {
    return Invalid(kOp, "layout and schedule disagree on T");
  }
  if (bounds_check_mode < 0 || bounds_check_mode > 3) {
    return Invalid(kOp, "bounds_check_mode must be 0 (FATAL), 1 (WARNING), 2 (IGNORE) or 3 (NONE), got " +
                            std::to_string(bounds_check_mode));
  }
  if (report->element_count() != 4) return Invalid(kOp, "the report result must be int32[4]");
  const bool sequence = batch.pooling == PoolingMode::kNone;
  ForwardArgs args;
  static_cast<TbeLayout&>(args) = batch.layout;
  args.schedule = {schedule.typed_data(), schedule.typed_data() + num_features + 1,
                   static_cast<int32_t>(num_features)};
  args.batch_size = batch.batch_size;
  args.total_dim = out->dimensions()[1];
  args.num_warps = static_cast<int32_t>(num_warps);
  args.num_indices = batch.num_indices;
  args.per_sample_weights = batch.weighted ? per_sample_weights.typed_data<float>() : nullptr;
  args.mean = batch.pooling == PoolingMode::kMean;
  args.mode = static_cast<BoundsCheckMode>(bounds_check_mode);
  args.report = args.mode == BoundsCheckMode::kNone
                    ? nullptr
                    : reinterpret_cast<BoundsCheckReport*>(report->typed_data());

  ffi::AnyBuffer* out_buffer = &(*out);
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    return DispatchFloatType<__half, __nv_bfloat16>(weights.element_type(), "weights", [&](auto weight_zero) {
      using W = decltype(weight_zero);
      return DispatchFloatType<__half, __nv_bfloat16>(out->element_type(), "output", [&](auto out_zero) {
        using O = decltype(out_zero);
        return Launch<W, O, I>(stream, weights, indices, offsets, out_buffer, args, sequence, labels);
      });
    });
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTbeForwardCuda, jaxrec::TbeForwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // weights
                                  .Arg<xla::ffi::AnyBuffer>()              // indices
                                  .Arg<xla::ffi::AnyBuffer>()              // offsets
                                  .Arg<xla::ffi::AnyBuffer>()              // per_sample_weights
                                  .Arg<xla::ffi::AnyBuffer>()              // layout
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // schedule
                                  .Ret<xla::ffi::AnyBuffer>()              // output
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // bounds-check report
                                  .Attr<int32_t>("pooling")
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int32_t>("bounds_check_mode")
                                  .Attr<std::string_view>("labels"));
