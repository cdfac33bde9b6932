// CUDA handler of jaxrec_tbe_fused_update: the TBE backward with the optimizer fused
// in. The table gradient is never materialised: each touched row is updated in place.
//
// The handler first sorts the batch's positions by row key (cuda/row_sort.cuh: a CUB
// radix sort over the bits of the row count). One group of lanes per run of equal keys (8 lanes for rows of
// up to 128 columns, four rows per warp, with the runs of 5 entries or more left to a second launch that
// gives each a warp; a warp for wider rows) then
//   1. sums the run's gradient rows in sorted order into registers (4 columns per lane
//      per chunk: the whole row stays in the group). A long run (a
//      Zipf head id: its length grows with the batch, and under sharding with the
//      global batch) is cut at the multiples of a window of the sorted order: a first
//      kernel sums each window's head (the part of a run that began in an earlier
//      window) into a scratch row, and the run's own group sums its first window and
//      then adds those partial rows, in window order;
//   2. loads the row's weights and optimizer state (Adam's family: before step 1),
//      applies UpdateRow (common/fused_optimizer.h; row sums are warp shuffles), and
//   3. stores the row and its state once, unless a value would not stay finite
//      (RowStaysFinite): then the row keeps its values and nonfinite_rows counts it.
// The row is the run's key less its feature's first row (the layout's first_rows), as
// in FBGEMM's backward; a run whose key is not a row of its head's feature's table is
// skipped: the sort already gives such positions the sentinel key, and with gradient
// clipping applied by the wrapper to grad_output (as FBGEMM does) the row math has none.
// No floating-point atomics: deterministic run to run. The weights and state arrive as results that
// alias their operands (input_output_aliases), so under buffer donation the update is
// in place; the handler reads them from the result buffers.
//
// This unit holds the handler; the kernels are in tbe_fused_update_kernels.cuh, compiled
// by tbe_fused_update_rowwise.cu and tbe_fused_update_adam.cu.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "common/ffi_util.h"
#include "common/fused_optimizer.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cuda/row_sort.cuh"
#include "cuda/tbe_backward_common.cuh"
#include "cuda/tbe_fused_update.cuh"
#include "cuda/tbe_util.cuh"

namespace jaxrec {
namespace {

using fused_update::FusedArgs;
using fused_update::kMaxChunks;
using fused_update::Launch;
using fused_update::LaunchFused;
using fused_update::LaunchWindowHeads;
using fused_update::RowLanes;
using fused_update::WindowShift;

constexpr std::string_view kOp = "jaxrec_tbe_fused_update";

ffi::Error Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kOp) + ": " + what + ": " + cudaGetErrorString(err));
}

// Copies an operand into its result when XLA did not alias the two buffers.
ffi::Error CopyIfNotAliased(cudaStream_t stream, const ffi::AnyBuffer& in, void* out, const char* what) {
  if (in.untyped_data() == out || in.size_bytes() == 0) return ffi::Error::Success();
  return Check(cudaMemcpyAsync(out, in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice, stream),
               what);
}

ffi::Error TbeFusedUpdateCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer grad,
                              ffi::AnyBuffer weights, ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                              ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout, ffi::AnyBuffer state1,
                              ffi::AnyBuffer state2, ffi::AnyBuffer hparams, ffi::AnyBuffer step,
                              ffi::Result<ffi::AnyBuffer> weights_out, ffi::Result<ffi::AnyBuffer> state1_out,
                              ffi::Result<ffi::AnyBuffer> state2_out, ffi::Result<ffi::AnyBuffer> grad_psw,
                              ffi::Result<ffi::AnyBuffer> nonfinite_rows, int32_t optimizer, int32_t pooling,
                              int32_t weight_decay_mode, int32_t stochastic_rounding, int32_t seed,
                              int32_t max_dim, int64_t total_rows) {
  TbeBatch batch;
  if (ffi::Error error = ValidateFusedUpdate(kOp, grad, weights, indices, offsets, per_sample_weights, layout,
                                             state1, state2, hparams, step, *weights_out, *state1_out,
                                             *state2_out, *grad_psw, *nonfinite_rows, optimizer, pooling,
                                             weight_decay_mode, max_dim, total_rows, &batch);
      error.failure()) {
    return error;
  }

  FusedArgs a;
  BackwardArgs& ga = a.grad;
  ga = MakeBackwardArgs(batch, grad, per_sample_weights);
  a.kind = static_cast<OptimizerKind>(optimizer);  // validated: one of the kinds
  a.hparams = hparams.typed_data<float>();
  a.step = step.typed_data<int32_t>();
  a.state1 = {state1_out->untyped_data(), state1.element_type()};
  a.state2 = {state2_out->untyped_data(), state2.element_type()};
  a.weight_decay_mode = static_cast<WeightDecayMode>(weight_decay_mode);
  a.stochastic_rounding = stochastic_rounding != 0;
  a.seed = static_cast<uint32_t>(seed);
  a.nonfinite_rows = nonfinite_rows->typed_data<int32_t>();
  a.limits = {FiniteLimit(weights.element_type()), FiniteLimit(state1.element_type()),
              FiniteLimit(state2.element_type())};
  if (ffi::Error e = Check(cudaMemsetAsync(a.nonfinite_rows, 0, sizeof(int32_t), stream), "memset");
      e.failure()) {
    return e;
  }

  for (auto [in, out, what] : {std::tuple{&weights, weights_out->untyped_data(), "weights copy"},
                               std::tuple{&state1, state1_out->untyped_data(), "state1 copy"},
                               std::tuple{&state2, state2_out->untyped_data(), "state2 copy"}}) {
    if (ffi::Error e = CopyIfNotAliased(stream, *in, out, what); e.failure()) return e;
  }
  float* gpsw = batch.weighted ? grad_psw->typed_data<float>() : nullptr;
  if (gpsw != nullptr) {
    if (ffi::Error e = Check(cudaMemsetAsync(gpsw, 0, grad_psw->size_bytes(), stream), "memset");
        e.failure()) {
      return e;
    }
  }
  if (ga.num_indices == 0 || ga.batch_size == 0) return ffi::Error::Success();
  const unsigned blocks = static_cast<unsigned>((ga.num_indices + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (max_dim > 128 * kMaxChunks)
    return Invalid(kOp, "dims above 1024 are not supported by the fused kernel");
  a.window_shift = WindowShift(RowLanes(KernelOf(a.kind), static_cast<int>(max_dim)));
  const int64_t windows = ((ga.num_indices - 1) >> a.window_shift) + 1;
  a.partials = nullptr;
  a.partial_width = max_dim;
  if (windows > 1) {  // XLA's scratch memory lives until the handler returns, stream-ordered
    std::optional<void*> buffer = scratch.Allocate(sizeof(float) * windows * max_dim, 16);
    if (!buffer.has_value()) return ffi::Error::Internal(std::string(kOp) + ": no scratch memory");
    a.partials = static_cast<float*>(*buffer);
  }
  const unsigned window_blocks = static_cast<unsigned>((windows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    SortedRows<I> sorted;
    if (ffi::Error e = SortByRow<I>(stream, scratch, kOp, ga, indices.typed_data<I>(),
                                    offsets.typed_data<I>(), total_rows, &sorted);
        e.failure()) {
      return e;
    }
    const Launch l{stream,
                   window_blocks,
                   grad.typed_data<float>(),
                   weights_out->untyped_data(),
                   offsets.untyped_data(),
                   sorted.keys,
                   sorted.positions,
                   sorted.bags};
    return DispatchFloatType<__half, __nv_bfloat16>(weights.element_type(), "weights", [&](auto weight_zero) {
      using W = decltype(weight_zero);
      if (gpsw != nullptr) {  // reads the weights before the update below changes them
        PerSampleWeightGradients<float, W, I><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
            grad.typed_data<float>(), static_cast<const W*>(l.weights), indices.typed_data<I>(),
            offsets.typed_data<I>(), gpsw, ga);
        if (ffi::Error e = Check(cudaGetLastError(), "per-sample weight gradients"); e.failure()) return e;
      }
      return DispatchOptimizer(optimizer, [&](auto kind) {
        LaunchWindowHeads<I>(l, static_cast<int>(max_dim), a);
        LaunchFused<KernelOf(decltype(kind)::value), W, I>(l, static_cast<int>(max_dim), a);
        return Check(cudaGetLastError(), "fused update");
      });
    });
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTbeFusedUpdateCuda, jaxrec::TbeFusedUpdateCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // grad_output
                                  .Arg<xla::ffi::AnyBuffer>()  // weights
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // per_sample_weights
                                  .Arg<xla::ffi::AnyBuffer>()  // layout
                                  .Arg<xla::ffi::AnyBuffer>()  // state1
                                  .Arg<xla::ffi::AnyBuffer>()  // state2
                                  .Arg<xla::ffi::AnyBuffer>()  // hparams
                                  .Arg<xla::ffi::AnyBuffer>()  // step
                                  .Ret<xla::ffi::AnyBuffer>()  // weights (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()  // state1 (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()  // state2 (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()  // grad_per_sample_weights
                                  .Ret<xla::ffi::AnyBuffer>()  // nonfinite_rows
                                  .Attr<int32_t>("optimizer")
                                  .Attr<int32_t>("pooling")
                                  .Attr<int32_t>("weight_decay_mode")
                                  .Attr<int32_t>("stochastic_rounding")
                                  .Attr<int32_t>("seed")
                                  .Attr<int32_t>("max_dim")
                                  .Attr<int64_t>("total_rows"));
