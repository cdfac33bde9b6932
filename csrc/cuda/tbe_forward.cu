// CUDA handler of the TBE forward (see common/tbe.h for the layout).
//
// One launch for all features. The warp schedule gives each feature groups of
// 2^shift lanes per bag (4 columns per lane per chunk), so a dim-16 table uses 4
// lanes per bag and 8 bags per warp, a dim-128 table a whole warp per bag. Each
// lane keeps kUnroll rows in flight (16-byte loads for f32) and sums in float32
// in index order: no atomics, the same result every run.
//
// Bad input reads nothing outside the feature's table nor the indices: each bag's
// range is clamped into [0, N] (ClampBag) and an id outside [0, rows) contributes
// nothing. Ids are clamped into the table as they are loaded; the rare bag where one
// had to be is pooled again over its valid ids only (PoolValidIds4).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
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
};

// The bag's weighted sum of columns [c, c + 4) for 4-aligned rows, each id clamped into
// [0, hi] so that every load is a row of the table; *clamped says whether any id had to
// be (the caller then pools the bag again with PoolValidIds4). Two integer ops and a
// compare per id, no extra pass over the ids; what that costs against the unchecked
// kernel is measured by benchmarks/tbe_guard_ab_gpu.py (docs/reliability.md).
template <typename W, typename I>
__device__ __forceinline__ float4 PoolColumns4(const W* __restrict__ table, const I* __restrict__ indices,
                                               const float* __restrict__ psw, I start, I end, I hi,
                                               int64_t dim, int64_t c, bool* clamped) {
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  bool any = false;
  I p = start;
  for (; p + kUnroll <= end; p += kUnroll) {
    float4 v[kUnroll];
    float w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const I id = indices[p + u];
      const I row = ClampId(id, hi);
      any |= row != id;
      v[u] = Load4(table + static_cast<int64_t>(row) * dim + c);
      w[u] = psw ? psw[p + u] : 1.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) Fma4(acc, w[u], v[u]);
  }
  for (; p < end; ++p) {
    const I id = indices[p];
    const I row = ClampId(id, hi);
    any |= row != id;
    Fma4(acc, psw ? psw[p] : 1.f, Load4(table + static_cast<int64_t>(row) * dim + c));
  }
  *clamped = any;
  return acc;
}

// The same sum over the ids inside [0, rows) only: the rare bag with a bad id (NONE
// drops it). One id at a time, so that it adds no registers to the common path.
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

// kSequence: PoolingMode::kNone, one output row per index position.
template <typename W, typename O, typename I, bool kSequence>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    TbeForwardKernel(const W* __restrict__ weights, const I* __restrict__ indices,
                     const I* __restrict__ offsets, O* __restrict__ out, ForwardArgs args) {
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
  I start, end;
  ClampBag<I>(offsets[bag], offsets[bag + 1], static_cast<I>(args.num_indices), &start, &end);
  const int64_t dim = __ldg(args.dims + f);
  const int64_t rows = __ldg(args.rows + f);
  // A table without rows has no row to clamp a bad id to: its bags read nothing.
  const I first = start;
  const I last = rows > 0 ? end : start;
  const W* table = weights + __ldg(args.table_offsets + f);
  const bool vector_rows = dim % 4 == 0 && __ldg(args.table_offsets + f) % 4 == 0;
  const float* psw = args.per_sample_weights;
  const int64_t chunk = int64_t{4} << shift;

  if constexpr (kSequence) {
    for (int64_t p = start; p < end; ++p) {
      const I id = indices[p];
      if (!RowInRange(id, rows)) continue;  // the output was zeroed: a zero row
      const W* row = table + static_cast<int64_t>(id) * dim;
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
    return;
  } else {
    O* out_row = out + b * args.total_dim + __ldg(args.output_offsets + f);
    const bool vector_out = args.total_dim % 4 == 0 && __ldg(args.output_offsets + f) % 4 == 0;
    const float scale = args.mean && end > start ? 1.f / static_cast<float>(end - start) : 1.f;
    const I hi = LastRow<I>(rows);
    for (int64_t c = 4 * group_lane; c < dim; c += chunk) {
      const int count = ColumnsLeft(dim, c);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (vector_rows) {
        bool clamped;
        acc = PoolColumns4(table, indices, psw, first, last, hi, dim, c, &clamped);
        if (clamped) acc = PoolValidIds4(table, indices, psw, first, last, rows, dim, c);
      } else {
        for (I p = first; p < last; ++p) {
          const I id = indices[p];
          if (RowInRange(id, rows)) {
            Fma4(acc, psw ? psw[p] : 1.f, LoadPartial4(table + static_cast<int64_t>(id) * dim + c, count));
          }
        }
      }
      acc = Scale4(acc, scale);
      if (vector_out && count == 4) {
        Store4(out_row + c, acc);
      } else {
        StorePartial4(out_row + c, acc, count);
      }
    }
  }
}

template <typename W, typename O, typename I>
ffi::Error Launch(cudaStream_t stream, const ffi::AnyBuffer& weights, const ffi::AnyBuffer& indices,
                  const ffi::AnyBuffer& offsets, ffi::AnyBuffer* out, const ForwardArgs& args,
                  bool sequence) {
  const unsigned blocks = (args.num_warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (sequence) {
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  }
  if (blocks > 0) {
    auto kernel = sequence ? TbeForwardKernel<W, O, I, true> : TbeForwardKernel<W, O, I, false>;
    kernel<<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
        reinterpret_cast<const W*>(weights.untyped_data()), indices.typed_data<I>(), offsets.typed_data<I>(),
        reinterpret_cast<O*>(out->untyped_data()), args);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxrec_tbe_forward launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

constexpr std::string_view kOp = "jaxrec_tbe_forward";

ffi::Error TbeForwardCuda(cudaStream_t stream, ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                          ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                          ffi::Buffer<ffi::S32> schedule, ffi::Result<ffi::AnyBuffer> out, int32_t pooling,
                          int64_t num_warps) {
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

  ffi::AnyBuffer* out_buffer = &(*out);
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    return DispatchFloatType<__half, __nv_bfloat16>(weights.element_type(), "weights", [&](auto weight_zero) {
      using W = decltype(weight_zero);
      return DispatchFloatType<__half, __nv_bfloat16>(out->element_type(), "output", [&](auto out_zero) {
        using O = decltype(out_zero);
        return Launch<W, O, I>(stream, weights, indices, offsets, out_buffer, args, sequence);
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
                                  .Attr<int32_t>("pooling")
                                  .Attr<int64_t>("num_warps"));
