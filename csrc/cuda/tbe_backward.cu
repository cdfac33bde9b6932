// CUDA handler of the TBE backward: the dense gradient of the flat weight buffer
// and the gradient of the per-sample weights (see common/tbe.h for the layout).
//
// The Python wrapper sorts the (row key, position) pairs with XLA's sort and hands
// over each sorted position's bag, so all uses of one table row are adjacent. One warp per run of equal keys
// sums the run's gradient rows in sorted order and writes the row once: no float atomics, the same result
// every run. Hot rows (long runs) are summed by a single warp.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cuda/tbe_backward_common.cuh"
#include "cuda/tbe_util.cuh"

namespace jaxrec {
namespace {

constexpr std::string_view kOp = "jaxrec_tbe_backward_sorted";

template <typename G, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    RowGradients(const G* __restrict__ grad, const I* __restrict__ indices, const I* __restrict__ offsets,
                 const I* __restrict__ sorted_keys, const I* __restrict__ sorted_positions,
                 const I* __restrict__ sorted_bags, float* __restrict__ grad_weights, BackwardArgs args) {
  const int64_t i = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (i >= args.num_indices) return;
  const I key = sorted_keys[i];
  if (key == std::numeric_limits<I>::max() || (i > 0 && sorted_keys[i - 1] == key)) return;

  const I first = sorted_positions[i];
  if (!EntryOk(args, indices, first, sorted_bags[i])) return;  // not a row of its table: skipped
  const int64_t f0 = sorted_bags[i] / args.batch_size;
  const int64_t dim = args.dims[f0];
  float* dest = grad_weights + args.table_offsets[f0] + static_cast<int64_t>(indices[first]) * dim;

  for (int64_t c = 4 * lane; c < dim; c += 4 * kWarpSize) {
    const int count = ColumnsLeft(dim, c);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t j = i; j < args.num_indices && sorted_keys[j] == key; ++j) {
      const I p = sorted_positions[j];
      const int64_t bag = sorted_bags[j];
      if (!RunEntryOk(args, p, bag)) continue;
      const int64_t f = bag / args.batch_size;
      Fma4(acc, PositionScale(args, offsets, bag, p), LoadAny4(GradRow(args, grad, bag, f, p) + c, count));
    }
    StoreAny4(dest + c, acc, count);
  }
}

ffi::Error Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kOp) + ": " + what + ": " + cudaGetErrorString(err));
}

template <typename G, typename W, typename I>
ffi::Error Run(cudaStream_t stream, const ffi::AnyBuffer& grad, const ffi::AnyBuffer& weights,
               const ffi::AnyBuffer& indices, const ffi::AnyBuffer& offsets,
               const ffi::AnyBuffer& sorted_keys, const ffi::AnyBuffer& sorted_positions,
               const ffi::AnyBuffer& sorted_bags, float* grad_weights, size_t grad_weights_bytes,
               float* grad_psw, const BackwardArgs& args) {
  if (ffi::Error e = Check(cudaMemsetAsync(grad_weights, 0, grad_weights_bytes, stream), "memset");
      e.failure()) {
    return e;
  }
  if (grad_psw != nullptr) {  // 0 wherever no bag reads the position: all of them for an empty batch
    if (ffi::Error e =
            Check(cudaMemsetAsync(grad_psw, 0, args.num_indices * sizeof(float), stream), "memset");
        e.failure()) {
      return e;
    }
  }
  const unsigned blocks = static_cast<unsigned>((args.num_indices + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (blocks == 0 || args.batch_size == 0) return ffi::Error::Success();
  RowGradients<G, I><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
      reinterpret_cast<const G*>(grad.untyped_data()), indices.typed_data<I>(), offsets.typed_data<I>(),
      sorted_keys.typed_data<I>(), sorted_positions.typed_data<I>(), sorted_bags.typed_data<I>(),
      grad_weights, args);
  if (ffi::Error e = Check(cudaGetLastError(), "row gradients"); e.failure()) return e;
  if (grad_psw != nullptr) {
    PerSampleWeightGradients<G, W, I><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
        reinterpret_cast<const G*>(grad.untyped_data()), reinterpret_cast<const W*>(weights.untyped_data()),
        indices.typed_data<I>(), offsets.typed_data<I>(), grad_psw, args);
    if (ffi::Error e = Check(cudaGetLastError(), "per-sample weight gradients"); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error TbeBackwardSortedCuda(cudaStream_t stream, ffi::AnyBuffer grad, ffi::AnyBuffer weights,
                                 ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                                 ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                                 ffi::AnyBuffer sorted_keys, ffi::AnyBuffer sorted_positions,
                                 ffi::AnyBuffer sorted_bags, ffi::Result<ffi::AnyBuffer> grad_weights,
                                 ffi::Result<ffi::AnyBuffer> grad_psw, int32_t pooling) {
  TbeBatch batch;
  if (ffi::Error error = ValidateBackward(kOp, grad, weights, indices, offsets, per_sample_weights, layout,
                                          *grad_weights, *grad_psw, pooling, &batch);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = ValidateSorted(kOp, indices, sorted_keys, sorted_positions, sorted_bags);
      error.failure()) {
    return error;
  }
  const BackwardArgs args = MakeBackwardArgs(batch, grad, per_sample_weights);
  float* gw = grad_weights->typed_data<float>();
  const size_t gw_bytes = grad_weights->size_bytes();
  float* gpsw = batch.weighted ? grad_psw->typed_data<float>() : nullptr;

  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    return DispatchFloatType<__half, __nv_bfloat16>(grad.element_type(), "grad_output", [&](auto grad_zero) {
      using G = decltype(grad_zero);
      return DispatchFloatType<__half, __nv_bfloat16>(
          weights.element_type(), "weights", [&](auto weight_zero) {
            using W = decltype(weight_zero);
            return Run<G, W, I>(stream, grad, weights, indices, offsets, sorted_keys, sorted_positions,
                                sorted_bags, gw, gw_bytes, gpsw, args);
          });
    });
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTbeBackwardSortedCuda, jaxrec::TbeBackwardSortedCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // grad_output
                                  .Arg<xla::ffi::AnyBuffer>()  // weights
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // per_sample_weights
                                  .Arg<xla::ffi::AnyBuffer>()  // layout
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_keys
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_positions
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_bags
                                  .Ret<xla::ffi::AnyBuffer>()  // grad_weights
                                  .Ret<xla::ffi::AnyBuffer>()  // grad_per_sample_weights
                                  .Attr<int32_t>("pooling"));
