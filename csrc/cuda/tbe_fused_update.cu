// CUDA handler of jaxrec_tbe_fused_update: the TBE backward with the optimizer fused
// in. The table gradient is never materialised: each touched row is updated in place.
//
// As in the backward, the Python wrapper sorts the (row key, position) pairs with XLA's
// sort (a CUB radix sort) and hands over each sorted position's bag. One warp per run
// of equal keys then
//   1. sums the run's gradient rows in sorted order into registers (4 columns per lane,
//      kChunks chunks of 128 columns: the whole row stays in the warp). A long run (a
//      Zipf head id: its length grows with the batch, and under sharding with the
//      global batch) is cut at the multiples of kWindow of the sorted order: a first
//      kernel sums each window's head (the part of a run that began in an earlier
//      window) into a scratch row, and the run's own warp sums its first window and
//      then adds those partial rows, in window order;
//   2. loads the row's weights and optimizer state, applies UpdateRow
//      (common/fused_optimizer.h; row sums are warp shuffles), and
//   3. stores the row and its state once, unless a value would not stay finite
//      (RowStaysFinite): then the row keeps its values and nonfinite_rows counts it.
// A run whose head is not a row of its feature's table (EntryOk) is skipped: the
// wrapper already gives such positions the sentinel key, and with gradient clipping
// applied by the wrapper to grad_output (as FBGEMM does) the row math has none.
// No atomics: deterministic run to run. The weights and state arrive as results that
// alias their operands (input_output_aliases), so under buffer donation the update is
// in place; the handler reads them from the result buffers.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "common/ffi_util.h"
#include "common/fused_optimizer.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cuda/tbe_backward_common.cuh"
#include "cuda/tbe_util.cuh"

namespace jaxrec {
namespace {

constexpr std::string_view kOp = "jaxrec_tbe_fused_update";
constexpr int kMaxChunks = 8;     // dims up to 8 * 128 = 1024 columns
constexpr int64_t kWindow = 256;  // sorted entries one warp sums before partial rows take over

// A state buffer of runtime dtype (float32, bfloat16 or float16); the branch is uniform.
struct StateBuffer {
  void* data;
  ffi::DataType dtype;

  template <typename T>
  __device__ __forceinline__ T* As() const {
    return static_cast<T*>(data);
  }

  __device__ __forceinline__ float4 Load4(int64_t i, int count) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        return LoadAny4(As<__nv_bfloat16>() + i, count);
      case ffi::DataType::F16:
        return LoadAny4(As<__half>() + i, count);
      default:
        return LoadAny4(As<float>() + i, count);
    }
  }
  __device__ __forceinline__ void Store4(int64_t i, float4 v, int count) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        StoreAny4(As<__nv_bfloat16>() + i, v, count);
        break;
      case ffi::DataType::F16:
        StoreAny4(As<__half>() + i, v, count);
        break;
      default:
        StoreAny4(As<float>() + i, v, count);
    }
  }
  __device__ __forceinline__ float Load(int64_t i) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        return ToFloat(As<__nv_bfloat16>()[i]);
      case ffi::DataType::F16:
        return ToFloat(As<__half>()[i]);
      default:
        return As<float>()[i];
    }
  }
  __device__ __forceinline__ void Store(int64_t i, float v) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        As<__nv_bfloat16>()[i] = FromFloat<__nv_bfloat16>(v);
        break;
      case ffi::DataType::F16:
        As<__half>()[i] = FromFloat<__half>(v);
        break;
      default:
        As<float>()[i] = v;
    }
  }
};

struct FusedArgs {
  BackwardArgs grad;
  const float* hparams;  // float32[9], device
  const int32_t* step;   // updates so far, device
  StateBuffer state1, state2;
  WeightDecayMode weight_decay_mode;
  bool stochastic_rounding;
  uint32_t seed;
  float* partials;          // [ceil(N / kWindow), max_dim]: each window's head sum (step 1)
  int64_t partial_width;    // max_dim
  int32_t* nonfinite_rows;  // rows kept because their update would not stay finite
  FiniteLimits limits;
};

// The row as one warp holds it: element i of lane `lane` is column 128 * (i / 4) + 4 * lane + i % 4.
template <int kChunks>
struct WarpRow {
  float w[4 * kChunks], g[4 * kChunks], s1[4 * kChunks], s2[4 * kChunks];
  int64_t dim;
  int lane;

  __device__ static constexpr int Size() { return 4 * kChunks; }
  __device__ __forceinline__ int64_t Column(int i) const { return 128 * (i / 4) + 4 * lane + i % 4; }
  __device__ __forceinline__ bool valid(int i) const { return Column(i) < dim; }
  __device__ __forceinline__ float Reduce(float x) const {
#pragma unroll
    for (int s = kWarpSize / 2; s > 0; s /= 2) x += __shfl_xor_sync(0xffffffff, x, s);
    return x;  // every lane holds the same sum (each butterfly step adds a pair both ways)
  }
  __device__ __forceinline__ bool All(bool ok) const { return __all_sync(0xffffffff, ok); }
};

__device__ __forceinline__ void Put4(float* dst, float4 v) {
  dst[0] = v.x;
  dst[1] = v.y;
  dst[2] = v.z;
  dst[3] = v.w;
}
__device__ __forceinline__ float4 Get4(const float* src) {
  return make_float4(src[0], src[1], src[2], src[3]);
}

template <typename W>
__device__ __forceinline__ float4 RoundStochastic4(float4 v, const FusedArgs& a, uint32_t step, int64_t key,
                                                   int64_t column) {
  constexpr int kDrop = sizeof(W) == 2 ? (std::is_same_v<W, __nv_bfloat16> ? 16 : 13) : 0;
  if constexpr (kDrop == 0) {
    return v;
  } else {
    return make_float4(StochasticRound(v.x, RoundingBits(a.seed, step, key, column), kDrop),
                       StochasticRound(v.y, RoundingBits(a.seed, step, key, column + 1), kDrop),
                       StochasticRound(v.z, RoundingBits(a.seed, step, key, column + 2), kDrop),
                       StochasticRound(v.w, RoundingBits(a.seed, step, key, column + 3), kDrop));
  }
}

// Adds to row.g the gradient rows of the sorted entries from `begin` on, up to `end` or
// the first entry of another key, in sorted order. The lanes read the entries 32 at a
// time (key, position, bag -> scale and gradient row) and the warp then walks them in
// order; the gradient loads of successive entries do not depend on each other, so many
// are in flight at once.
template <int kChunks, typename I>
__device__ __forceinline__ void SumEntries(WarpRow<kChunks>& row, const float* __restrict__ grad,
                                           const I* __restrict__ offsets, const I* __restrict__ sorted_keys,
                                           const I* __restrict__ sorted_positions,
                                           const I* __restrict__ sorted_bags, const BackwardArgs& ga,
                                           int64_t begin, int64_t end, I key) {
#pragma unroll
  for (int e = 0; e < row.Size(); ++e) row.g[e] = 0.f;
  for (int64_t base = begin;; base += kWarpSize) {
    const int64_t j = base + row.lane;
    const bool mine = j < end && sorted_keys[j] == key;  // a prefix of the lanes
    unsigned long long g_address = 0;
    float scale = 0.f;
    if (mine) {
      const I p = sorted_positions[j];
      const int64_t bag = sorted_bags[j];
      if (RunEntryOk(ga, p, bag)) {  // else address 0: the entry is skipped below
        scale = PositionScale(ga, offsets, bag, p);
        g_address = reinterpret_cast<unsigned long long>(GradRow(ga, grad, bag, bag / ga.batch_size, p));
      }
    }
    const int n = __popc(__ballot_sync(0xffffffff, mine));
#pragma unroll 8
    for (int t = 0; t < n; ++t) {
      const float* g = reinterpret_cast<const float*>(__shfl_sync(0xffffffff, g_address, t));
      const float entry_scale = __shfl_sync(0xffffffff, scale, t);
      if (g == nullptr) continue;  // the same for every lane: no divergence
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int64_t c = 128 * k + 4 * row.lane;
        if (c < row.dim) {
          float4 acc = Get4(row.g + 4 * k);
          Fma4(acc, entry_scale, LoadAny4(g + c, ColumnsLeft(row.dim, c)));
          Put4(row.g + 4 * k, acc);
        }
      }
    }
    if (n < kWarpSize) break;
  }
}

// Step 1's partial rows: warp w sums the head of window w, the entries from w * kWindow
// on whose key is that of the entry before (a run that began in an earlier window).
template <int kChunks, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    WindowHeads(const float* __restrict__ grad, const I* __restrict__ offsets,
                const I* __restrict__ sorted_keys, const I* __restrict__ sorted_positions,
                const I* __restrict__ sorted_bags, FusedArgs a) {
  const BackwardArgs& ga = a.grad;
  const int64_t w = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t begin = w * kWindow;
  if (begin == 0 || begin >= ga.num_indices) return;
  const I key = sorted_keys[begin];
  if (key == std::numeric_limits<I>::max() || sorted_keys[begin - 1] != key) return;
  if (!RunEntryOk(ga, sorted_positions[begin], sorted_bags[begin])) return;  // its run is skipped too
  WarpRow<kChunks> row;
  row.lane = threadIdx.x % kWarpSize;
  row.dim = ga.dims[sorted_bags[begin] / ga.batch_size];
  SumEntries(row, grad, offsets, sorted_keys, sorted_positions, sorted_bags, ga, begin,
             std::min(begin + kWindow, ga.num_indices), key);
  float* partial = a.partials + w * a.partial_width;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t c = 128 * k + 4 * row.lane;
    if (c < row.dim) StoreAny4(partial + c, Get4(row.g + 4 * k), ColumnsLeft(row.dim, c));
  }
}

template <OptimizerKind kKind, int kChunks, typename W, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    FusedUpdate(const float* __restrict__ grad, W* __restrict__ weights, const I* __restrict__ indices,
                const I* __restrict__ offsets, const I* __restrict__ sorted_keys,
                const I* __restrict__ sorted_positions, const I* __restrict__ sorted_bags, FusedArgs a) {
  const BackwardArgs& ga = a.grad;
  const int64_t i = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  WarpRow<kChunks> row;
  row.lane = threadIdx.x % kWarpSize;
  if (i >= ga.num_indices) return;
  const I key = sorted_keys[i];
  if (key == std::numeric_limits<I>::max() || (i > 0 && sorted_keys[i - 1] == key)) return;
  if (!EntryOk(ga, indices, sorted_positions[i], sorted_bags[i])) return;  // not a row of its table

  const int64_t f0 = sorted_bags[i] / ga.batch_size;
  row.dim = ga.dims[f0];
  const int64_t row_start =
      ga.table_offsets[f0] + static_cast<int64_t>(indices[sorted_positions[i]]) * row.dim;

  // 1. The row's summed gradient, in sorted order: the run's entries in its first window,
  // then the head sums of the windows it continues into.
  const int64_t window_end = std::min((i / kWindow + 1) * kWindow, ga.num_indices);
  SumEntries(row, grad, offsets, sorted_keys, sorted_positions, sorted_bags, ga, i, window_end, key);
  for (int64_t w = i / kWindow + 1; w * kWindow < ga.num_indices && sorted_keys[w * kWindow] == key; ++w) {
    const float* partial = a.partials + w * a.partial_width;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = 128 * k + 4 * row.lane;
      if (c < row.dim) {
        float4 acc = Get4(row.g + 4 * k);
        Fma4(acc, 1.f, LoadAny4(partial + c, ColumnsLeft(row.dim, c)));
        Put4(row.g + 4 * k, acc);
      }
    }
  }

  // 2. Weights and state in, the optimizer, 3. out.
  constexpr bool kS1Row = State1PerRow(kKind), kS2Row = State2PerRow(kKind);
  constexpr int kStates = NumStates(kKind);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t c = 128 * k + 4 * row.lane;
    const bool in = c < row.dim;
    const int count = in ? ColumnsLeft(row.dim, c) : 0;
    Put4(row.w + 4 * k, in ? LoadAny4(weights + row_start + c, count) : make_float4(0.f, 0.f, 0.f, 0.f));
    if constexpr (kStates >= 1 && !kS1Row) {
      Put4(row.s1 + 4 * k, in ? a.state1.Load4(row_start + c, count) : make_float4(0.f, 0.f, 0.f, 0.f));
    }
    if constexpr (kStates >= 2 && !kS2Row) {
      Put4(row.s2 + 4 * k, in ? a.state2.Load4(row_start + c, count) : make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
  float s1_row = 0.f, s2_row = 0.f;
  if constexpr (kS1Row) s1_row = a.state1.Load(key);
  if constexpr (kS2Row) s2_row = a.state2.Load(key);

  RowUpdateArgs ua;
  ua.h = Hyperparams::Load(a.hparams);
  const int32_t new_step = *a.step + 1;
  ua.step = static_cast<float>(new_step);
  ua.dim = static_cast<float>(row.dim);
  ua.weight_decay_mode = a.weight_decay_mode;
  UpdateRow<kKind>(row, ua, s1_row, s2_row);

  // Stochastic rounding first, so that the check sees the values that would be stored;
  // the row keeps its old values if one would not be finite.
  if (a.stochastic_rounding) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = 128 * k + 4 * row.lane;
      Put4(row.w + 4 * k,
           RoundStochastic4<W>(Get4(row.w + 4 * k), a, static_cast<uint32_t>(new_step), key, c));
    }
  }
  if (!RowStaysFinite<kKind>(row, s1_row, s2_row, a.limits)) {
    if (row.lane == 0) atomicAdd(a.nonfinite_rows, 1);
    return;
  }

#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t c = 128 * k + 4 * row.lane;
    if (c >= row.dim) continue;
    const int count = ColumnsLeft(row.dim, c);
    StoreAny4(weights + row_start + c, Get4(row.w + 4 * k), count);
    if constexpr (kStates >= 1 && !kS1Row) a.state1.Store4(row_start + c, Get4(row.s1 + 4 * k), count);
    if constexpr (kStates >= 2 && !kS2Row) a.state2.Store4(row_start + c, Get4(row.s2 + 4 * k), count);
  }
  if (row.lane == 0) {
    if constexpr (kS1Row) a.state1.Store(key, s1_row);
    if constexpr (kS2Row) a.state2.Store(key, s2_row);
  }
}

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

struct Launch {
  cudaStream_t stream;
  unsigned blocks;
  unsigned window_blocks;  // of WindowHeads
  const float* grad;
  void* weights;
  const void* indices;
  const void* offsets;
  const void* sorted_keys;
  const void* sorted_positions;
  const void* sorted_bags;
};

template <OptimizerKind kKind, typename W, typename I>
void LaunchFused(const Launch& l, int chunks, const FusedArgs& a) {
  const auto launch = [&](auto heads, auto kernel) {
    if (a.partials != nullptr) {
      heads<<<l.window_blocks, kWarpsPerBlock * kWarpSize, 0, l.stream>>>(
          l.grad, static_cast<const I*>(l.offsets), static_cast<const I*>(l.sorted_keys),
          static_cast<const I*>(l.sorted_positions), static_cast<const I*>(l.sorted_bags), a);
    }
    kernel<<<l.blocks, kWarpsPerBlock * kWarpSize, 0, l.stream>>>(
        l.grad, static_cast<W*>(l.weights), static_cast<const I*>(l.indices),
        static_cast<const I*>(l.offsets), static_cast<const I*>(l.sorted_keys),
        static_cast<const I*>(l.sorted_positions), static_cast<const I*>(l.sorted_bags), a);
  };
  if (chunks <= 1) {
    launch(WindowHeads<1, I>, FusedUpdate<kKind, 1, W, I>);
  } else if (chunks <= 4) {
    launch(WindowHeads<4, I>, FusedUpdate<kKind, 4, W, I>);
  } else {
    launch(WindowHeads<kMaxChunks, I>, FusedUpdate<kKind, kMaxChunks, W, I>);
  }
}

ffi::Error TbeFusedUpdateCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer grad,
                              ffi::AnyBuffer weights, ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                              ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                              ffi::AnyBuffer sorted_keys, ffi::AnyBuffer sorted_positions,
                              ffi::AnyBuffer sorted_bags, ffi::AnyBuffer state1, ffi::AnyBuffer state2,
                              ffi::AnyBuffer hparams, ffi::AnyBuffer step,
                              ffi::Result<ffi::AnyBuffer> weights_out, ffi::Result<ffi::AnyBuffer> state1_out,
                              ffi::Result<ffi::AnyBuffer> state2_out, ffi::Result<ffi::AnyBuffer> grad_psw,
                              ffi::Result<ffi::AnyBuffer> nonfinite_rows, int32_t optimizer, int32_t pooling,
                              int32_t weight_decay_mode, int32_t stochastic_rounding, int32_t seed,
                              int32_t max_dim) {
  TbeBatch batch;
  if (ffi::Error error = ValidateFusedUpdate(
          kOp, grad, weights, indices, offsets, per_sample_weights, layout, sorted_keys, sorted_positions,
          sorted_bags, state1, state2, hparams, step, *weights_out, *state1_out, *state2_out, *grad_psw,
          *nonfinite_rows, optimizer, pooling, weight_decay_mode, max_dim, &batch);
      error.failure()) {
    return error;
  }

  FusedArgs a;
  BackwardArgs& ga = a.grad;
  ga = MakeBackwardArgs(batch, grad, per_sample_weights);
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
  const int chunks = static_cast<int>((max_dim + 127) / 128);
  if (chunks > kMaxChunks) return Invalid(kOp, "dims above 1024 are not supported by the fused kernel");
  const int64_t windows = (ga.num_indices + kWindow - 1) / kWindow;
  a.partials = nullptr;
  a.partial_width = max_dim;
  if (windows > 1) {  // XLA's scratch memory lives until the handler returns, stream-ordered
    std::optional<void*> buffer = scratch.Allocate(sizeof(float) * windows * max_dim, 16);
    if (!buffer.has_value()) return ffi::Error::Internal(std::string(kOp) + ": no scratch memory");
    a.partials = static_cast<float*>(*buffer);
  }
  const unsigned window_blocks = static_cast<unsigned>((windows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const Launch l{stream,
                 blocks,
                 window_blocks,
                 grad.typed_data<float>(),
                 weights_out->untyped_data(),
                 indices.untyped_data(),
                 offsets.untyped_data(),
                 sorted_keys.untyped_data(),
                 sorted_positions.untyped_data(),
                 sorted_bags.untyped_data()};

  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    return DispatchFloatType<__half, __nv_bfloat16>(weights.element_type(), "weights", [&](auto weight_zero) {
      using W = decltype(weight_zero);
      if (gpsw != nullptr) {  // reads the weights before the update below changes them
        PerSampleWeightGradients<float, W, I><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
            grad.typed_data<float>(), static_cast<const W*>(l.weights), indices.typed_data<I>(),
            offsets.typed_data<I>(), gpsw, ga);
        if (ffi::Error e = Check(cudaGetLastError(), "per-sample weight gradients"); e.failure()) return e;
      }
      return DispatchOptimizer(optimizer, [&](auto kind) {
        LaunchFused<decltype(kind)::value, W, I>(l, chunks, a);
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
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_keys
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_positions
                                  .Arg<xla::ffi::AnyBuffer>()  // sorted_bags
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
                                  .Attr<int32_t>("max_dim"));
