// Pieces shared by the TBE backward and the fused update: the problem's arguments
// (bound from the shared validation's TbeBatch), the gradient row and scale of a
// position, and the per-sample-weight gradient kernel (which must read the weights
// before the fused update changes them).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cuda/tbe_util.cuh"

namespace jaxrec {

constexpr int kWarpsPerBlock = 8;

// The layout's arrays (table_offsets, dims, rows, output_offsets in device memory) and
// T, and the batch.
struct BackwardArgs : TbeLayout {
  int64_t batch_size;
  int64_t num_indices;
  int64_t grad_row_width;           // pooled: total_dim; sequence: dim
  const float* per_sample_weights;  // nullptr when unweighted
  bool mean;
  bool sequence;
};

// The arguments of the batch that the shared validation described (common/tbe_validate.h).
inline BackwardArgs MakeBackwardArgs(const TbeBatch& batch, ffi::AnyBuffer grad_output,
                                     ffi::AnyBuffer per_sample_weights) {
  BackwardArgs args;
  static_cast<TbeLayout&>(args) = batch.layout;
  args.batch_size = batch.batch_size;
  args.num_indices = batch.num_indices;
  args.grad_row_width = grad_output.dimensions()[1];
  args.per_sample_weights = batch.weighted ? per_sample_weights.typed_data<float>() : nullptr;
  args.mean = batch.pooling == PoolingMode::kMean;
  args.sequence = batch.pooling == PoolingMode::kNone;
  return args;
}

// Whether a sorted entry names a position in [0, N), a bag in [0, T*B) and an id inside
// its feature's table. The wrapper gives every other position the sentinel key
// (row_keys); the kernels check the head of each run again, so no row outside the
// feature's table is read or written whatever keys they are handed.
template <typename I>
__device__ __forceinline__ bool EntryOk(const BackwardArgs& args, const I* indices, int64_t p, int64_t bag) {
  return p >= 0 && p < args.num_indices && bag >= 0 && bag < args.num_features * args.batch_size &&
         RowInRange(indices[p], args.rows[bag / args.batch_size]);
}

// Whether entry j of a run (whose head passed EntryOk, so the row is good) has a
// position and a bag to read the gradient of: no memory access, a compare or two.
__device__ __forceinline__ bool RunEntryOk(const BackwardArgs& args, int64_t p, int64_t bag) {
  return p >= 0 && p < args.num_indices && bag >= 0 && bag < args.num_features * args.batch_size;
}

template <typename I>
__device__ __forceinline__ int64_t BagOf(const I* offsets, int64_t num_bags, I position) {
  int64_t lo = 0, hi = num_bags;  // offsets[lo] <= position < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= position)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Factor of position p in bag `bag`: its per-sample weight, over L for MEAN.
template <typename I>
__device__ __forceinline__ float PositionScale(const BackwardArgs& args, const I* offsets, int64_t bag, I p) {
  float scale = args.per_sample_weights ? args.per_sample_weights[p] : 1.f;
  if (args.mean) scale /= static_cast<float>(offsets[bag + 1] - offsets[bag]);
  return scale;
}

template <typename G, typename I>
__device__ __forceinline__ const G* GradRow(const BackwardArgs& args, const G* grad, int64_t bag, int64_t f,
                                            I p) {
  if (args.sequence) return grad + static_cast<int64_t>(p) * args.grad_row_width;
  return grad + (bag - f * args.batch_size) * args.grad_row_width + args.output_offsets[f];
}

// grad_psw[p] = <grad row of p's bag, weight row of p> (over L for MEAN); one warp per position.
template <typename G, typename W, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    PerSampleWeightGradients(const G* __restrict__ grad, const W* __restrict__ weights,
                             const I* __restrict__ indices, const I* __restrict__ offsets,
                             float* __restrict__ grad_psw, BackwardArgs args) {
  const int64_t p = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_bags = args.num_features * args.batch_size;
  if (p >= args.num_indices || num_bags == 0) return;
  if (p < offsets[0] || p >= offsets[num_bags]) return;  // padding: left at 0
  const int64_t bag = BagOf(offsets, num_bags, static_cast<I>(p));
  const int64_t f = bag / args.batch_size;
  if (!RowInRange(indices[p], args.rows[f])) return;  // a dropped id: its gradient stays 0
  const int64_t dim = args.dims[f];
  const W* row = weights + args.table_offsets[f] + static_cast<int64_t>(indices[p]) * dim;
  const G* g = GradRow(args, grad, bag, f, static_cast<I>(p));
  float dot = 0.f;
  for (int64_t c = 4 * lane; c < dim; c += 4 * kWarpSize) {
    const int count = ColumnsLeft(dim, c);
    const float4 a = LoadPartial4(g + c, count), w = LoadPartial4(row + c, count);
    dot += a.x * w.x + a.y * w.y + a.z * w.z + a.w * w.w;
  }
  for (int s = kWarpSize / 2; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffff, dot, s);
  if (lane == 0) {
    const float scale = args.mean ? 1.f / static_cast<float>(offsets[bag + 1] - offsets[bag]) : 1.f;
    grad_psw[p] = dot * scale;
  }
}

}  // namespace jaxrec
