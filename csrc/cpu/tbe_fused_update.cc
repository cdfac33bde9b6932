// CPU handler of the fused sparse optimizer step (jaxrec_tbe_fused_update): applies an
// optimizer, in place, to the embedding rows a batch touched, from the gradient of the
// pooled (or sequence) output. The math of a row is common/fused_optimizer.h (UpdateRow);
// the jnp reference is jaxrec.optim.fused_update_reference.
//
// Operands: grad_output (F32, the forward output's shape), weights (F32/F16/BF16, flat),
// indices, offsets, per_sample_weights ([N] or [0]), layout, state1, state2 (F32/F16/BF16, or [0] when the
// optimizer has fewer), hparams (F32[9]), step (S32 scalar: updates so far). Results: weights, state1, state2
// (aliased to their operands by the wrapper; updated in place) and grad_per_sample_weights (F32 [N] or [0],
// from the weights *before* the update) and nonfinite_rows (S32 scalar: the rows kept because their update
// would not stay finite; common/fused_optimizer.h). Attributes: optimizer, pooling, weight_decay_mode,
// stochastic_rounding, seed, max_dim (the layout's largest dim, checked), total_rows (all tables' rows, which
// every row key is below; checked). FBGEMM's gradient clipping is applied by the wrapper, to grad_output.
//
// The handler first sorts the positions (cpu/row_sort.h) by key = first row of the
// feature's table among all tables' rows + id (the dtype's max outside bags and for an
// id outside its table), so the uses of one table row form a run of equal keys:
//
//   sorted_keys       [ 3  3  3 | 7 | 9  9 | max max ]     <- runs; the sentinels last
//   sorted_positions  [ 0  4  6 | 2 | 1  5 |  3   7  ]     (ascending within a run)
//   items             [ item 0        | item 1       ]     an item owns the runs that
//                                                          start in it (9 9 -> item 1)
//
// For each run: g = sum over its positions p, in sorted order, of scale_p * grad row of
// p (scale_p = per-sample weight, / bag length for MEAN); then the row's weights and
// state are loaded as float32, updated by UpdateRow and stored back rounded. Each row
// is updated by one item and summed in a fixed order, so the result does not depend on
// the thread schedule. Per-element state is laid out like the weights; per-row state
// holds one value per row at index key.
//
// The kernel checks each run's head again (EntryOk) and skips a run whose row is not in
// its table: no row or state outside the feature's table is ever read or written.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/ffi_util.h"
#include "common/fused_optimizer.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cpu/row_sort.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace {

constexpr std::string_view kOp = "jaxrec_tbe_fused_update";
constexpr int64_t kMinItem = 1024;  // sorted entries per work item
constexpr int64_t kMaxItem = 4096;
constexpr int64_t kPrefetchDistance = 8;          // sorted entries ahead
constexpr int64_t kCopyChunk = int64_t{1} << 22;  // bytes copied per item (non-aliased results)

// The row a CPU thread owns, for UpdateRow: the whole row, so a row sum is the sum.
struct CpuRow {
  float* w;
  float* g;
  float* s1;
  float* s2;
  int n;
  int Size() const { return n; }
  bool valid(int) const { return true; }
  float Reduce(float x) const { return x; }
  bool All(bool ok) const { return ok; }
};

// A result buffer of runtime dtype (the weights, a state); its dtype is switched on once
// per row, not per element.
struct FloatBuffer {
  void* data;  // nullptr for a state the optimizer does not have
  ffi::DataType dtype;
};

template <typename T>
JAXREC_ALWAYS_INLINE void LoadRow(const T* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToFloat(src[i]);
}

template <typename T>
JAXREC_ALWAYS_INLINE void StoreRow(const float* __restrict src, int64_t n, T* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
}

// Elements [start, start + n) of a buffer as float32, and back (round to nearest).
JAXREC_ALWAYS_INLINE void LoadFloats(const FloatBuffer& s, int64_t start, int64_t n, float* dst) {
  switch (s.dtype) {
    case ffi::DataType::F32:
      return LoadRow(static_cast<const float*>(s.data) + start, n, dst);
    case ffi::DataType::BF16:
      return LoadRow(static_cast<const BFloat16*>(s.data) + start, n, dst);
    default:
      return LoadRow(static_cast<const Half*>(s.data) + start, n, dst);
  }
}

JAXREC_ALWAYS_INLINE void StoreFloats(const FloatBuffer& s, int64_t start, int64_t n, const float* src) {
  switch (s.dtype) {
    case ffi::DataType::F32:
      return StoreRow(src, n, static_cast<float*>(s.data) + start);
    case ffi::DataType::BF16:
      return StoreRow(src, n, static_cast<BFloat16*>(s.data) + start);
    default:
      return StoreRow(src, n, static_cast<Half*>(s.data) + start);
  }
}

JAXREC_ALWAYS_INLINE void PrefetchFloats(const FloatBuffer& s, int64_t start, int64_t n) {
  if (s.data == nullptr) return;
  const int64_t width = s.dtype == ffi::DataType::F32 ? 4 : 2;
  PrefetchBytes(static_cast<const char*>(s.data) + start * width, n * width);
}

template <typename I>
struct UpdateArgs {
  const float* grad_output;
  const I* indices;
  const I* offsets;
  const float* per_sample_weights;  // nullptr when not weighted
  const I* sorted_keys;
  const I* sorted_positions;
  const I* sorted_bags;
  int64_t num_sorted;  // N
  TbeLayout layout;
  int64_t batch_size;
  int64_t total_dim;
  int64_t max_dim;
  PoolingMode pooling;
  OptimizerKind kind;   // its kernel is KernelOf(kind)
  FloatBuffer weights;  // the result buffer, updated in place
  FloatBuffer state1, state2;
  float* grad_per_sample_weights;  // nullptr when not weighted
  RowUpdateArgs row_args;          // its dim is set per row
  bool stochastic_rounding;
  uint32_t seed;
  uint32_t step;  // t = updates so far + 1
  FiniteLimits limits;
};

// Updates the rows whose runs start in sorted entries [begin, end); returns how many were
// kept because their update would not stay finite. `scratch` holds 4 * max_dim floats.
// One instantiation per kernel (KernelOf) and index type: the optimizer of a shared kernel
// and the weights' dtype are switched on once per row.
template <OptimizerKind kKind, typename I>
JAXREC_ALWAYS_INLINE int64_t UpdateItem(const UpdateArgs<I>& a, int64_t begin, int64_t end, float* scratch) {
  constexpr I kSentinel = std::numeric_limits<I>::max();
  constexpr bool kState1 = NumStates(kKind) >= 1, kState2 = NumStates(kKind) >= 2;
  constexpr bool kRow1 = State1PerRow(kKind), kRow2 = State2PerRow(kKind);  // else per element
  const I* __restrict keys = a.sorted_keys;
  const I* __restrict positions = a.sorted_positions;
  const I* __restrict bags = a.sorted_bags;
  const TbeLayout& l = a.layout;
  const int64_t n = a.num_sorted, B = a.batch_size;
  const bool pooled = a.pooling != PoolingMode::kNone, mean = a.pooling == PoolingMode::kMean;
  float* __restrict w = scratch;
  float* __restrict g = w + a.max_dim;
  float* __restrict s1 = g + a.max_dim;
  float* __restrict s2 = s1 + a.max_dim;

  // Whether sorted entry i names a position, a bag and an id inside its feature's table.
  const int64_t num_bags = l.num_features * B;
  const auto entry_ok = [&](int64_t i) {
    const int64_t p = positions[i], bag = bags[i];
    return p >= 0 && p < n && bag >= 0 && bag < num_bags && RowInRange(a.indices[p], l.rows[bag / B]);
  };
  // Element offset of the table row of sorted entry i (entry_ok), and its dim.
  const auto row_start = [&](int64_t i, int64_t* dim) {
    const int64_t f = bags[i] / B;
    *dim = l.dims[f];
    return l.table_offsets[f] + static_cast<int64_t>(a.indices[positions[i]]) * *dim;
  };
  const auto grad_row = [&](int64_t p, int64_t bag, int64_t dim) {
    if (!pooled) return a.grad_output + p * dim;
    const int64_t f = bag / B;
    return a.grad_output + (bag - f * B) * a.total_dim + l.output_offsets[f];
  };
  const auto prefetch = [&](int64_t i) {  // the grad row of entry i, and its table row if it starts a run
    if (i >= n || keys[i] == kSentinel || !entry_ok(i)) return;
    int64_t dim;
    const int64_t start = row_start(i, &dim);
    PrefetchBytes(grad_row(positions[i], bags[i], dim), dim * static_cast<int64_t>(sizeof(float)));
    if (keys[i] == keys[i - 1]) return;
    PrefetchFloats(a.weights, start, dim);
    if constexpr (kState1) PrefetchFloats(a.state1, kRow1 ? keys[i] : start, kRow1 ? 1 : dim);
    if constexpr (kState2) PrefetchFloats(a.state2, kRow2 ? keys[i] : start, kRow2 ? 1 : dim);
  };

  int64_t kept = 0;
  int64_t i = begin;
  while (i > 0 && i < end && keys[i] == keys[i - 1]) ++i;  // that run belongs to an earlier item
  while (i < end && keys[i] != kSentinel) {
    const I key = keys[i];
    if (!entry_ok(i)) {  // not a row of its feature's table: the whole run is skipped
      while (i < n && keys[i] == key) ++i;
      continue;
    }
    int64_t dim;
    const int64_t start = row_start(i, &dim);
    LoadFloats(a.weights, start, dim, w);
    std::fill(g, g + dim, 0.0f);

    // The run's gradient, in sorted order; the per-sample-weight gradient from the old row.
    int64_t j = i;
    for (; j < n && keys[j] == key; ++j) {
      prefetch(j + kPrefetchDistance);
      if (!entry_ok(j)) continue;
      const int64_t p = positions[j], bag = bags[j];
      const float* __restrict grow = grad_row(p, bag, dim);
      float scale = 1.0f;
      if (pooled) {
        const float length = mean ? static_cast<float>(a.offsets[bag + 1] - a.offsets[bag]) : 1.0f;
        if (a.per_sample_weights != nullptr) {
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += grow[d] * w[d];
          a.grad_per_sample_weights[p] = mean ? dot / length : dot;
          scale = a.per_sample_weights[p];
        }
        if (mean) scale /= length;
      }
      for (int64_t d = 0; d < dim; ++d) g[d] += scale * grow[d];
    }

    // The optimizer step on the row, then the stores.
    float s1_row = 0.0f, s2_row = 0.0f;
    if constexpr (kState1) LoadFloats(a.state1, kRow1 ? key : start, kRow1 ? 1 : dim, kRow1 ? &s1_row : s1);
    if constexpr (kState2) LoadFloats(a.state2, kRow2 ? key : start, kRow2 ? 1 : dim, kRow2 ? &s2_row : s2);
    CpuRow row{w, g, s1, s2, static_cast<int>(dim)};
    RowUpdateArgs args = a.row_args;
    args.dim = static_cast<float>(dim);
    UpdateRowIn<kKind>(a.kind, row, args, s1_row, s2_row);

    if (a.stochastic_rounding && a.weights.dtype != ffi::DataType::F32) {
      const int drop = a.weights.dtype == ffi::DataType::BF16 ? 16 : 13;
      for (int64_t d = 0; d < dim; ++d) {
        w[d] = StochasticRound(w[d], RoundingBits(a.seed, a.step, key, d), drop);
      }
    }
    if (!RowStaysFinite<kKind>(row, s1_row, s2_row, a.limits)) {  // the row keeps its old values
      ++kept;
      i = j;
      continue;
    }
    StoreFloats(a.weights, start, dim, w);
    if constexpr (kState1) StoreFloats(a.state1, kRow1 ? key : start, kRow1 ? 1 : dim, kRow1 ? &s1_row : s1);
    if constexpr (kState2) StoreFloats(a.state2, kRow2 ? key : start, kRow2 ? 1 : dim, kRow2 ? &s2_row : s2);
    i = j;
  }
  return kept;
}

template <OptimizerKind kKind, typename I>
int64_t UpdateItemBaseline(const UpdateArgs<I>& a, int64_t begin, int64_t end, float* scratch) {
  return UpdateItem<kKind, I>(a, begin, end, scratch);
}
#if JAXREC_HAS_ISA_CLONES
template <OptimizerKind kKind, typename I>
JAXREC_TARGET_AVX2 int64_t UpdateItemAvx2(const UpdateArgs<I>& a, int64_t begin, int64_t end,
                                          float* scratch) {
  return UpdateItem<kKind, I>(a, begin, end, scratch);
}
template <OptimizerKind kKind, typename I>
JAXREC_TARGET_AVX512 int64_t UpdateItemAvx512(const UpdateArgs<I>& a, int64_t begin, int64_t end,
                                              float* scratch) {
  return UpdateItem<kKind, I>(a, begin, end, scratch);
}
#endif

template <OptimizerKind kKind, typename I>
auto SelectUpdateItem() {
#if JAXREC_HAS_ISA_CLONES
  switch (CpuIsa()) {
    case Isa::kAvx512:
      return &UpdateItemAvx512<kKind, I>;
    case Isa::kAvx2:
      return &UpdateItemAvx2<kKind, I>;
    case Isa::kBaseline:
      break;
  }
#endif
  return &UpdateItemBaseline<kKind, I>;
}

// Returns the number of rows kept because their update would not stay finite.
template <OptimizerKind kKind, typename I>
int64_t FusedUpdate(ffi::ThreadPool& pool, const UpdateArgs<I>& a) {
  if (a.grad_per_sample_weights != nullptr) {  // positions outside bags stay 0
    std::memset(a.grad_per_sample_weights, 0, a.num_sorted * sizeof(float));
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t item = std::clamp<int64_t>(a.num_sorted / (4 * threads), kMinItem, kMaxItem);
  const auto item_fn = SelectUpdateItem<kKind, I>();
  std::atomic<int64_t> kept{0};
  ParallelFor(pool, (a.num_sorted + item - 1) / item, [&](int64_t k) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < 4 * a.max_dim) scratch.resize(4 * a.max_dim);
    const int64_t n = item_fn(a, k * item, std::min(a.num_sorted, (k + 1) * item), scratch.data());
    if (n > 0) kept.fetch_add(n, std::memory_order_relaxed);
  });
  return kept.load();
}

// Copies `from` into `to` unless XLA gave the same buffer (input_output_aliases).
void CopyUnlessAliased(ffi::ThreadPool& pool, ffi::AnyBuffer from, ffi::AnyBuffer to) {
  if (from.untyped_data() == to.untyped_data() || from.size_bytes() == 0) return;
  const char* src = static_cast<const char*>(from.untyped_data());
  char* dst = static_cast<char*>(to.untyped_data());
  const int64_t bytes = from.size_bytes();
  ParallelFor(pool, (bytes + kCopyChunk - 1) / kCopyChunk, [&](int64_t k) {
    const int64_t begin = k * kCopyChunk;
    std::memcpy(dst + begin, src + begin, std::min(kCopyChunk, bytes - begin));
  });
}

ffi::Error TbeFusedUpdateCpu(ffi::ThreadPool pool, ffi::AnyBuffer grad_output, ffi::AnyBuffer weights,
                             ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                             ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout, ffi::AnyBuffer state1,
                             ffi::AnyBuffer state2, ffi::AnyBuffer hparams, ffi::AnyBuffer step,
                             ffi::Result<ffi::AnyBuffer> weights_out, ffi::Result<ffi::AnyBuffer> state1_out,
                             ffi::Result<ffi::AnyBuffer> state2_out,
                             ffi::Result<ffi::AnyBuffer> grad_per_sample_weights,
                             ffi::Result<ffi::AnyBuffer> nonfinite_rows, int32_t optimizer, int32_t pooling,
                             int32_t weight_decay_mode, int32_t stochastic_rounding, int32_t seed,
                             int32_t max_dim, int64_t total_rows) {
  TbeProblem problem;
  if (ffi::Error error = ValidateFusedUpdate(
          kOp, grad_output, weights, indices, offsets, per_sample_weights, layout, state1, state2, hparams,
          step, *weights_out, *state1_out, *state2_out, *grad_per_sample_weights, *nonfinite_rows, optimizer,
          pooling, weight_decay_mode, max_dim, total_rows, &problem);
      error.failure()) {
    return error;
  }
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    if (ffi::Error error = ValidateContents<I>(kOp, weights, offsets, &problem); error.failure()) {
      return error;
    }
    if (max_dim != problem.max_dim) {
      return Invalid(kOp, "max_dim is " + std::to_string(max_dim) + " but the layout's largest dim is " +
                              std::to_string(problem.max_dim));
    }
    if (ffi::Error error = CheckShape(kOp, "grad_output", grad_output.dimensions(), problem.out_dims);
        error.failure()) {
      return error;
    }
    const int64_t n = problem.num_indices;
    const TbeLayout& l = problem.layout;
    std::unique_ptr<I[]> keys(new I[n]), positions(new I[n]), bags(new I[n]);  // all written by the sort
    int64_t layout_rows = 0;
    if (ffi::Error error =
            SortByRow<I, int64_t>(pool, kOp, indices.typed_data<I>(), n, offsets.typed_data<I>(),
                                  static_cast<int64_t>(offsets.element_count()) - 1, l.rows, l.first_rows,
                                  l.num_features, keys.get(), positions.get(), bags.get(), &layout_rows);
        error.failure()) {
      return error;
    }
    // Every row key must be < total_rows (tables that no feature reads may follow).
    if (layout_rows > total_rows) {
      return Invalid(kOp, "total_rows is " + std::to_string(total_rows) +
                              " but the layout's features read rows up to " + std::to_string(layout_rows));
    }

    return DispatchOptimizer(optimizer, [&](auto kind) {
      constexpr OptimizerKind kKind = decltype(kind)::value;
      // XLA hands aliased results over holding the operands' data; copy where it did not alias.
      CopyUnlessAliased(pool, weights, *weights_out);
      CopyUnlessAliased(pool, state1, *state1_out);
      CopyUnlessAliased(pool, state2, *state2_out);

      const int32_t t = step.typed_data<int32_t>()[0] + 1;
      const UpdateArgs<I> args{
          grad_output.typed_data<float>(),
          indices.typed_data<I>(),
          offsets.typed_data<I>(),
          problem.weighted ? per_sample_weights.typed_data<float>() : nullptr,
          keys.get(),
          positions.get(),
          bags.get(),
          n,
          problem.layout,
          problem.batch_size,
          problem.total_dim,
          problem.max_dim,
          problem.pooling,
          kKind,
          {weights_out->untyped_data(), weights.element_type()},
          {NumStates(kKind) >= 1 ? state1_out->untyped_data() : nullptr, state1.element_type()},
          {NumStates(kKind) >= 2 ? state2_out->untyped_data() : nullptr, state2.element_type()},
          problem.weighted ? grad_per_sample_weights->typed_data<float>() : nullptr,
          RowUpdateArgs{Hyperparams::Load(hparams.typed_data<float>()), static_cast<float>(t), 0.0f,
                        static_cast<WeightDecayMode>(weight_decay_mode)},
          stochastic_rounding != 0,
          static_cast<uint32_t>(seed),
          static_cast<uint32_t>(t),
          {FiniteLimit(weights.element_type()), FiniteLimit(state1.element_type()),
           FiniteLimit(state2.element_type())}};
      // The weights' dtype is checked again (ValidateLookup did); UpdateItem switches on it per row.
      return DispatchFloatType<Half, BFloat16>(weights.element_type(), "weights", [&](auto) {
        const int64_t kept = FusedUpdate<KernelOf(kKind), I>(pool, args);
        nonfinite_rows->typed_data<int32_t>()[0] =
            static_cast<int32_t>(std::min<int64_t>(kept, std::numeric_limits<int32_t>::max()));
        return ffi::Error::Success();
      });
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTbeFusedUpdateCpu, jaxrec::cpu::TbeFusedUpdateCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
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
                                  .Ret<xla::ffi::AnyBuffer>()  // weights (aliases operand 1)
                                  .Ret<xla::ffi::AnyBuffer>()  // state1 (aliases operand 6)
                                  .Ret<xla::ffi::AnyBuffer>()  // state2 (aliases operand 7)
                                  .Ret<xla::ffi::AnyBuffer>()  // grad_per_sample_weights
                                  .Ret<xla::ffi::AnyBuffer>()  // nonfinite_rows
                                  .Attr<int32_t>("optimizer")
                                  .Attr<int32_t>("pooling")
                                  .Attr<int32_t>("weight_decay_mode")
                                  .Attr<int32_t>("stochastic_rounding")
                                  .Attr<int32_t>("seed")
                                  .Attr<int32_t>("max_dim")       // the layout's largest dim
                                  .Attr<int64_t>("total_rows"));  // the tables' row count
